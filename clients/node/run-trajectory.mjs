// Run one multi-turn agentic trajectory on a Prorsa cluster and print what happened as one JSON line.
//
//   node run-trajectory.mjs --nats nats://127.0.0.1:4222 [--turns 3] [--traj-id node-1] [--max-tokens 24]
//
// The "agent" is scripted: a first prompt, then per turn a model call, a tool call whose observation is a few
// hundred token ids appended to the context, and the next turn on the whole context; then a reward. Exits 1 (after
// printing the summary) if the cluster answered any of its messages with an error_reply.

import { parseArgs } from "node:util";
import { RolloutClient } from "./prorsa.mjs";

const { values } = parseArgs({
  options: {
    nats: { type: "string", default: process.env.PRORSA_NATS_URL ?? "nats://127.0.0.1:4222" },
    namespace: { type: "string", default: process.env.PRORSA_NAMESPACE ?? "prorsa" },
    "traj-id": { type: "string", default: `node-${process.pid}` },
    turns: { type: "string", default: "3" },
    "max-tokens": { type: "string", default: "24" },
    "prompt-tokens": { type: "string", default: "600" },
    "observation-tokens": { type: "string", default: "150" },
    "tool-s": { type: "string", default: "1.0" },
    "timeout-s": { type: "string", default: "60" },
  },
});
const turns = Number(values.turns);
const maxTokens = Number(values["max-tokens"]);
const vocab = 32000;
const ids = (n, seed) => Array.from({ length: n }, (_, i) => 1 + ((seed * 7919 + i * 104729) % (vocab - 1)));

const client = await RolloutClient.connect(values.nats, { namespace: values.namespace });
await new Promise((r) => setTimeout(r, 1200)); // one round of engine_stats: affinity works from the second turn
const traj = await client.startTrajectory({
  trajId: values["traj-id"],
  task: "coding",
  promptTokens: Number(values["prompt-tokens"]),
});
let context = ids(Number(values["prompt-tokens"]), 1);
const summary = { traj_id: traj.trajId, client_id: client.clientId, turns: [] };
for (let k = 0; k < turns; k++) {
  let streamed = 0;
  const out = await traj.generate(context, { max_tokens: maxTokens, ignore_eos: true, seed: k }, {
    onTokens: (t) => (streamed += t.length),
    timeoutS: Number(values["timeout-s"]),
  });
  summary.turns.push({
    request_id: out.requestId,
    prompt_tokens: context.length,
    output_tokens: out.tokenIds.length,
    streamed_tokens: streamed,
    logprobs: out.logprobs ? out.logprobs.length : null,
    cached_tokens: out.cachedTokens,
    engine_id: out.engineId,
    prefill_engine: out.prefillEngine,
    finish_reason: out.finishReason,
    restarts: out.restarts,
  });
  context = context.concat(out.tokenIds);
  if (k + 1 < turns) {
    await traj.toolStarted("bash");
    await new Promise((r) => setTimeout(r, (Number(values["tool-s"]) * 1000) / client.timeScale));
    const observation = ids(Number(values["observation-tokens"]), k + 2);
    await traj.toolFinished("bash", observation.length);
    context = context.concat(observation);
  }
}
await traj.finish(1.0);
await new Promise((r) => setTimeout(r, 300)); // error replies to the last events, if any, arrive
summary.error_replies = client.errorReplies;
summary.bad_messages = client.badMessages;
summary.dropped_chunks = client.droppedChunks;
summary.lifecycle_events = client.seq;
await client.close();
console.log(JSON.stringify(summary));
process.exit(summary.error_replies.length ? 1 : 0);

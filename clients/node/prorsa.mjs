// A trainer-side Prorsa client for Node.js, written from proto/README.md alone (no code shared with the Python SDK).
//
//   const client = await RolloutClient.connect("nats://127.0.0.1:4222");
//   const traj = await client.startTrajectory({ task: "coding" });
//   const out = await traj.generate(promptIds, { max_tokens: 64 });
//   await traj.toolStarted("bash"); ...; await traj.toolFinished("bash", observationIds.length);
//   await traj.finish(1.0);
//   await client.close();
//
// What it does on the bus (each rule is in proto/README.md, "Joining from another language"):
// - lifecycle events go to `ns.lifecycle` by JetStream publish (acknowledged, so none is lost), numbered per client
//   (`source`, `seq` = 1, 2, ...) and de-duplicated by the server through the `Nats-Msg-Id` header `<source>:<seq>`;
// - each turn is a `generate_request` on `ns.work.prefill.engine.<id>` when the engine of the previous turn can take
//   it (fresh `engine_stats`, a prefill-capable role, not switching, a short queue), else on `ns.work.prefill.any`;
//   its `Nats-Msg-Id` is `<request_id>#<attempt>`;
// - the output streams back as `token_chunk`s on the request's `reply_to`, assembled exactly once (StreamAssembler);
// - a turn with no progress for `retryAfterS` is republished with `attempt` + 1; the first complete stream wins;
// - timestamps are Unix seconds times the cluster's time scale (PRORSA_TIME_SCALE; 1 with real engines);
// - the lean wire ("The context log"): before each turn, its prompt segment (the ids after the previous turn's prompt,
//   when the new prompt extends it) goes to `ns.ctx.<traj_id>.<turn>` as 32-bit little-endian ids, and the request
//   carries only those ids (none past `inlineMaxTokens`) with the reference; the log is purged when the trajectory
//   finishes. `leanWire: false` sends the whole context every turn. A request over the server's max_payload is
//   refused here (PayloadTooLarge), before anything is published.
// The wire format is JSON: every message has `type` and `schema_version`, and this client rejects any other version.

import { connect, headers as natsHeaders } from "@nats-io/transport-node";
import { jetstream, jetstreamManager } from "@nats-io/jetstream";

export const SCHEMA_VERSION = 2;
export const INLINE_MAX_TOKENS = 16384; // segment ids sent inline at most; beyond, engines read them from the log
const PART_OVERHEAD_BYTES = 1024; // room for headers under max_payload in each context-log part
const MAX_PART_TOKENS = 262144;
const PREFILL_CAPABLE = new Set(["prefill", "mixed"]);
const TOKEN = /^[A-Za-z0-9_\-:]+$/;

/** A message this client cannot accept (wrong version, wrong type, missing field). */
export class ProtoError extends Error {}

/** The engine rejected the turn (its final chunk carries `error`); retrying will not help. */
export class GenerateError extends Error {}

/** A turn's request exceeds the server's max_payload: it is never published. */
export class PayloadTooLarge extends GenerateError {}

export function checkToken(value, what) {
  if (typeof value !== "string" || !TOKEN.test(value) || value.length > 200) {
    throw new Error(`invalid ${what} ${JSON.stringify(value)}: use letters, digits, '_', '-' or ':'`);
  }
  return value;
}

/** The subject and stream names of proto/README.md under one namespace. */
export class Subjects {
  constructor(namespace = "prorsa") {
    this.ns = checkToken(namespace, "namespace");
    const upper = this.ns.toUpperCase().replace(/[-:]/g, "_");
    this.workStream = `${upper}_WORK`;
    this.eventsStream = `${upper}_EVENTS`;
    this.contextStream = `${upper}_CONTEXT`;
    this.lifecycle = `${this.ns}.lifecycle`;
    this.prefillWorkAny = `${this.ns}.work.prefill.any`;
    this.allEngineStats = `${this.ns}.stats.*`;
    this.errors = `${this.ns}.errors`;
  }
  prefillWorkFor(engineId) {
    return `${this.ns}.work.prefill.engine.${checkToken(engineId, "engine id")}`;
  }
  context(trajId, turn) {
    return `${this.ns}.ctx.${checkToken(trajId, "trajectory id")}.${turn}`;
  }
  contextOf(trajId) {
    return `${this.ns}.ctx.${checkToken(trajId, "trajectory id")}.>`;
  }
  reply(clientId, n) {
    return `${this.ns}.reply.${checkToken(clientId, "client id")}.${n}`;
  }
}

/** Token ids as unsigned 32-bit little-endian bytes (the context log's body). */
export function packIds(ids) {
  const out = new Uint8Array(ids.length * 4);
  const view = new DataView(out.buffer);
  ids.forEach((id, i) => {
    if (!Number.isInteger(id) || id < 0 || id > 0xffffffff) throw new Error(`token id ${id} is not in 0..2^32-1`);
    view.setUint32(i * 4, id, true);
  });
  return out;
}

/** The messages of one segment of the context log under `maxPayload`: [{ headers, body }], at least one. */
export function segmentParts(prefixTurn, prefixLen, ids, maxPayload) {
  const step = Math.min(MAX_PART_TOKENS, Math.floor((maxPayload - PART_OVERHEAD_BYTES) / 4));
  const n = Math.max(1, Math.ceil(ids.length / step));
  const parts = [];
  for (let i = 0; i < n; i++) {
    parts.push({
      headers: {
        "Prorsa-Prefix-Turn": String(prefixTurn),
        "Prorsa-Prefix-Len": String(prefixLen),
        "Prorsa-Tokens": String(ids.length),
        "Prorsa-Part": `${i}/${n}`,
      },
      body: packIds(ids.slice(i * step, (i + 1) * step)),
    });
  }
  return parts;
}

const encoder = new TextEncoder();
const decoder = new TextDecoder();

/** JSON bytes of a message: `type` and `schema_version` first, then the fields. */
export function encode(type, fields) {
  return encoder.encode(JSON.stringify({ type, schema_version: SCHEMA_VERSION, ...fields }));
}

/** The message in `data`, which must be of `type`; raises ProtoError naming the subject and what is wrong. */
export function decodeAs(data, type, subject, required = []) {
  let msg;
  try {
    msg = JSON.parse(decoder.decode(data));
  } catch (err) {
    throw new ProtoError(`cannot decode message on ${subject}: not JSON (${err.message})`);
  }
  if (msg === null || typeof msg !== "object") throw new ProtoError(`message on ${subject} is not an object`);
  if (msg.schema_version !== SCHEMA_VERSION) {
    throw new ProtoError(`message on ${subject}: schema version ${msg.schema_version} (this client speaks ${SCHEMA_VERSION})`);
  }
  if (msg.type !== type) throw new ProtoError(`message on ${subject}: type ${msg.type}, expected ${type}`);
  for (const name of required) {
    if (!(name in msg)) throw new ProtoError(`message on ${subject}: field ${name} missing`);
  }
  return msg;
}

/** One request's token stream from `token_chunk`s, exactly once (the rules of proto/README.md). */
export class StreamAssembler {
  constructor(requestId) {
    this.requestId = requestId;
    this.chunks = new Map(); // index -> chunk
    this.engineId = "";
    this.finalIndex = null;
    this.restarts = 0;
    this.duplicates = 0;
    this.result = null;
  }

  /** Take one chunk; the result the first time the stream is complete, else null. */
  add(chunk) {
    if (this.result !== null || chunk.request_id !== this.requestId) {
      this.duplicates += 1;
      return null;
    }
    // Index 0 from another engine than the one streaming: the request restarted from scratch elsewhere (its
    // first engine died and the work queue redelivered it), so what came before is void.
    if (chunk.index === 0 && this.engineId && chunk.engine_id !== this.engineId && this.chunks.has(0)) {
      this.chunks.clear();
      this.finalIndex = null;
      this.restarts += 1;
    }
    if (this.chunks.has(chunk.index)) {
      this.duplicates += 1;
      return null;
    }
    this.chunks.set(chunk.index, chunk);
    if (chunk.index === 0 || !this.engineId) this.engineId = chunk.engine_id ?? "";
    if (chunk.finished) this.finalIndex = chunk.index;
    if (this.finalIndex === null) return null;
    for (let i = 0; i <= this.finalIndex; i++) if (!this.chunks.has(i)) return null;
    const ordered = [];
    for (let i = 0; i <= this.finalIndex; i++) ordered.push(this.chunks.get(i));
    const last = ordered[ordered.length - 1];
    const withLogprobs = ordered.every((c) => Array.isArray(c.logprobs));
    this.result = {
      requestId: this.requestId,
      tokenIds: ordered.flatMap((c) => c.token_ids),
      logprobs: withLogprobs ? ordered.flatMap((c) => c.logprobs) : null,
      finishReason: last.finish_reason ?? "",
      engineId: last.engine_id ?? "",
      prefillEngine: last.prefill_engine ?? "",
      promptTokens: last.prompt_tokens ?? 0,
      cachedTokens: last.cached_tokens ?? 0,
      ttftS: last.ttft_s ?? 0,
      e2eS: last.e2e_s ?? 0,
      policyVersion: last.policy_version ?? 0,
      restarts: this.restarts,
      error: last.error ?? "",
    };
    return this.result;
  }
}

/** Which engine may take a trajectory's next turn directly, from the `engine_stats` it publishes every second. */
export class EngineDirectory {
  constructor({ staleAfterS = 3.0, maxWaiting = 8 } = {}) {
    this.staleAfterS = staleAfterS;
    this.maxWaiting = maxWaiting;
    this.engines = new Map(); // engine id -> { stats, seenAtMs }
  }
  observe(stats, nowMs) {
    const prev = this.engines.get(stats.engine_id);
    if (prev && stats.ts_s < prev.stats.ts_s) return; // reordered: keep the newer picture
    this.engines.set(stats.engine_id, { stats, seenAtMs: nowMs });
  }
  affinityTarget(engineId, nowMs) {
    const seen = this.engines.get(engineId);
    if (!seen || nowMs - seen.seenAtMs > this.staleAfterS * 1000) return null;
    const s = seen.stats;
    if (!PREFILL_CAPABLE.has(s.role) || s.switching || (s.waiting ?? 0) > this.maxWaiting) return null;
    return engineId;
  }
}

function randomHex(n) {
  let out = "";
  for (let i = 0; i < n; i++) out += Math.floor(Math.random() * 16).toString(16);
  return out;
}

export class RolloutClient {
  /** Connect, wait for the cluster's streams, subscribe to token streams and engine stats. */
  static async connect(url, options = {}) {
    const nc = await connect({ servers: url.split(","), maxReconnectAttempts: -1, reconnectTimeWait: 250 });
    const client = new RolloutClient(nc, options);
    await client.start(options.streamWaitS ?? 30);
    return client;
  }

  constructor(
    nc,
    { namespace = "prorsa", clientId, timeScale, retryAfterS = 120, maxAttempts = 3, leanWire = true, inlineMaxTokens = INLINE_MAX_TOKENS } = {},
  ) {
    this.nc = nc;
    this.js = jetstream(nc);
    this.subjects = new Subjects(namespace);
    this.clientId = checkToken(clientId ?? `node-${randomHex(8)}`, "client id");
    this.timeScale = timeScale ?? Number(process.env.PRORSA_TIME_SCALE || 1);
    this.retryAfterS = retryAfterS;
    this.maxAttempts = maxAttempts;
    this.leanWire = leanWire;
    this.inlineMaxTokens = inlineMaxTokens;
    this.runId = randomHex(12); // makes context-log message ids unique to this client's writes
    this.directory = new EngineDirectory();
    this.seq = 0;
    this.pending = new Map(); // request id -> { assembler, lastProgressMs, onDone }
    this.subs = [];
    this.badMessages = 0;
    this.droppedChunks = 0;
    this.errorReplies = []; // every error_reply seen on ns.errors while connected
  }

  /** Virtual seconds: the timestamp every service of the cluster uses. */
  nowS() {
    return (Date.now() / 1000) * this.timeScale;
  }

  async start(streamWaitS) {
    // The services create the WORK and EVENTS streams; publishing before they exist gets no acknowledgement.
    const jsm = await jetstreamManager(this.nc);
    const deadline = Date.now() + streamWaitS * 1000;
    this.jsm = jsm;
    for (const name of [this.subjects.workStream, this.subjects.eventsStream, this.subjects.contextStream]) {
      for (;;) {
        try {
          await jsm.streams.info(name);
          break;
        } catch (err) {
          if (Date.now() > deadline) throw new Error(`stream ${name} does not exist: is a Prorsa cluster up? (${err.message})`);
          await new Promise((r) => setTimeout(r, 250));
        }
      }
    }
    // Subscribe before the first request: chunks are core NATS, so one sent before the subscription is lost.
    this.subs.push(this.nc.subscribe(`${this.subjects.ns}.reply.${this.clientId}.>`, { callback: (e, m) => this.onChunk(e, m) }));
    this.subs.push(this.nc.subscribe(this.subjects.allEngineStats, { callback: (e, m) => this.onStats(e, m) }));
    this.subs.push(this.nc.subscribe(this.subjects.errors, { callback: (e, m) => this.onError(e, m) }));
    await this.nc.flush();
  }

  async close() {
    await this.nc.drain();
  }

  onChunk(err, msg) {
    if (err) return;
    let chunk;
    try {
      chunk = decodeAs(msg.data, "token_chunk", msg.subject, ["request_id", "index", "token_ids"]);
    } catch (e) {
      if (!(e instanceof ProtoError)) throw e;
      this.badMessages += 1;
      return;
    }
    const p = this.pending.get(chunk.request_id);
    if (!p) {
      this.droppedChunks += 1; // a late chunk of a finished turn or of another attempt
      return;
    }
    p.lastProgressMs = Date.now();
    const before = p.assembler.duplicates;
    const result = p.assembler.add(chunk);
    if (p.assembler.duplicates > before) this.droppedChunks += 1;
    else if (p.onTokens && chunk.token_ids.length) p.onTokens(chunk.token_ids);
    if (result) p.onDone(result);
  }

  onStats(err, msg) {
    if (err) return;
    try {
      this.directory.observe(decodeAs(msg.data, "engine_stats", msg.subject, ["engine_id", "ts_s", "role"]), Date.now());
    } catch (e) {
      if (!(e instanceof ProtoError)) throw e;
      this.badMessages += 1;
    }
  }

  onError(err, msg) {
    if (err) return;
    try {
      this.errorReplies.push(decodeAs(msg.data, "error_reply", msg.subject, ["kind", "error"]));
    } catch (e) {
      if (!(e instanceof ProtoError)) throw e;
      this.badMessages += 1;
    }
  }

  /** Publish one lifecycle event into the EVENTS stream; resolves once the server has stored it. */
  async emit(type, fields) {
    this.seq += 1;
    const body = { ts_s: this.nowS(), source: this.clientId, seq: this.seq, ...fields };
    await this.js.publish(this.subjects.lifecycle, encode(type, body), { msgID: `${this.clientId}:${this.seq}` });
  }

  async startTrajectory({ trajId, task = "", policyVersion = 0, group = "", promptTokens = 0 } = {}) {
    const traj = new Trajectory(this, checkToken(trajId ?? `t-${randomHex(12)}`, "trajectory id"), task, policyVersion);
    await this.emit("trajectory_started", {
      traj_id: traj.trajId,
      task,
      policy_version: policyVersion,
      group,
      prompt_tokens: promptTokens,
    });
    return traj;
  }

  /** Send a generate_request and wait for its whole output; republish (attempt + 1) a turn that shows no progress. */
  async submit(request, { onTokens, timeoutS } = {}) {
    const assembler = new StreamAssembler(request.request_id);
    let resolveDone;
    const done = new Promise((r) => (resolveDone = r));
    const pending = { assembler, lastProgressMs: Date.now(), onTokens, onDone: (res) => resolveDone(res) };
    this.pending.set(request.request_id, pending);
    const deadline = timeoutS ? Date.now() + timeoutS * 1000 : Infinity;
    try {
      for (let attempt = 0; attempt < this.maxAttempts; attempt++) {
        await this.publishRequest({ ...request, attempt });
        pending.lastProgressMs = Date.now();
        const result = await this.waitStalled(pending, done, deadline);
        if (result) {
          if (result.error) throw new GenerateError(result.error);
          return result;
        }
      }
      throw new Error(`request ${request.request_id} made no progress after ${this.maxAttempts} attempts`);
    } finally {
      this.pending.delete(request.request_id);
    }
  }

  /** The result, or null once the request made no progress for retryAfterS (the caller then retries). */
  async waitStalled(pending, done, deadline) {
    for (;;) {
      const now = Date.now();
      if (now > deadline) throw new Error(`request ${pending.assembler.requestId} timed out`);
      const left = this.retryAfterS * 1000 - (now - pending.lastProgressMs);
      if (left <= 0) return null;
      let timer;
      const tick = new Promise((r) => (timer = setTimeout(() => r(null), Math.min(left, 1000))));
      const result = await Promise.race([done, tick]);
      clearTimeout(timer);
      if (result) return result;
    }
  }

  /** The server's max_payload in bytes (what it announced on connect). */
  get maxPayload() {
    return this.nc.info?.max_payload ?? 1024 * 1024;
  }

  /** The request's bytes; throws PayloadTooLarge past the server's max_payload. */
  encodeRequest(req) {
    const data = encode("generate_request", req);
    if (data.length > this.maxPayload) {
      throw new PayloadTooLarge(
        `turn ${req.request_id}: the request is ${data.length} bytes (${req.prompt_token_ids.length} prompt ids inline), ` +
          `over the server's max_payload of ${this.maxPayload} bytes; use the lean wire or raise max_payload`,
      );
    }
    return data;
  }

  /** Write one turn's prompt segment to the context log (before the turn is published). */
  async logSegment(trajId, turn, prefixTurn, prefixLen, ids) {
    const subject = this.subjects.context(trajId, turn);
    const parts = segmentParts(prefixTurn, prefixLen, ids, this.maxPayload);
    for (const [i, part] of parts.entries()) {
      const h = natsHeaders();
      for (const [k, v] of Object.entries(part.headers)) h.set(k, v);
      await this.js.publish(subject, part.body, { headers: h, msgID: `ctx:${this.runId}:${trajId}:${turn}:${i}` });
    }
  }

  /** Drop a finished trajectory's context log; a failure is only reported (the stream's max age removes it). */
  async purgeContext(trajId) {
    try {
      await this.jsm.streams.purge(this.subjects.contextStream, { filter: this.subjects.contextOf(trajId) });
    } catch (err) {
      console.warn(`prorsa: could not purge the context log of ${trajId}: ${err.message}`);
    }
  }

  async publishRequest(req) {
    const target = req.affinity_engine ? this.directory.affinityTarget(req.affinity_engine, Date.now()) : null;
    const subject = target ? this.subjects.prefillWorkFor(target) : this.subjects.prefillWorkAny;
    await this.js.publish(subject, this.encodeRequest(req), { msgID: `${req.request_id}#${req.attempt}` });
  }
}

/** One trajectory's turns and tool calls; keeps its turn counter, context length and engine affinity. */
export class Trajectory {
  constructor(client, trajId, task, policyVersion) {
    this.client = client;
    this.trajId = trajId;
    this.task = task;
    this.policyVersion = policyVersion;
    this.turn = 0;
    this.contextTokens = 0;
    this.affinityEngine = "";
    this.results = [];
    this.finished = false;
    this.loggedPrompt = null; // lean wire: a copy of the last prompt logged, and its turn
    this.loggedTurn = 0;
  }

  /** [prefixTurn, prefixLen] when `ids` extends the last logged prompt, else [0, 0]. */
  prefixOf(ids) {
    const prev = this.loggedPrompt;
    if (!prev || prev.length === 0 || ids.length < prev.length) return [0, 0];
    for (let i = 0; i < prev.length; i++) if (ids[i] !== prev[i]) return [0, 0];
    return [this.loggedTurn, prev.length];
  }

  /** Run one model turn on the whole context `promptIds`; resolves to its output ids, logprobs and engines. */
  async generate(promptIds, sampling, { onTokens, timeoutS } = {}) {
    if (this.finished) throw new Error(`trajectory ${this.trajId} is finished`);
    const requestId = `${this.trajId}:${this.turn}`;
    const n = promptIds.length;
    const lean = this.client.leanWire && n > 0;
    const [prefixTurn, prefixLen] = lean ? this.prefixOf(promptIds) : [0, 0];
    const segment = promptIds.slice(prefixLen);
    const inline = !lean || segment.length <= this.client.inlineMaxTokens ? segment : [];
    const request = {
      request_id: requestId,
      traj_id: this.trajId,
      turn: this.turn,
      prompt_token_ids: inline,
      prompt_len: n,
      sampling: {
        max_tokens: sampling.max_tokens,
        temperature: sampling.temperature ?? 1.0,
        top_p: sampling.top_p ?? 1.0,
        top_k: sampling.top_k ?? -1,
        seed: sampling.seed ?? null,
        logprobs: sampling.logprobs ?? true,
        stop_token_ids: sampling.stop_token_ids ?? [],
        ignore_eos: sampling.ignore_eos ?? false,
      },
      reply_to: this.client.subjects.reply(this.client.clientId, this.turn),
      policy_version: this.policyVersion,
      task: this.task,
      affinity_engine: this.affinityEngine,
      attempt: 0,
      submitted_s: this.client.nowS(),
      prefix_turn: prefixTurn,
      prefix_len: prefixLen,
      context_logged: lean,
    };
    this.client.encodeRequest(request); // before anything is published: a turn that cannot be sent is never seen
    if (lean) {
      await this.client.logSegment(this.trajId, this.turn, prefixTurn, prefixLen, segment);
      this.loggedPrompt = promptIds.slice();
      this.loggedTurn = this.turn;
    }
    await this.client.emit("turn_submitted", {
      traj_id: this.trajId,
      turn: this.turn,
      request_id: requestId,
      prompt_tokens: n,
      new_tokens: Math.max(0, n - this.contextTokens),
    });
    const result = await this.client.submit(request, { onTokens, timeoutS });
    this.results.push(result);
    this.affinityEngine = result.prefillEngine || result.engineId;
    this.contextTokens = n + result.tokenIds.length;
    this.turn += 1;
    return result;
  }

  /** The tool call made by the output of the turn just generated (`turn` names that turn). */
  async toolStarted(tool = "") {
    await this.client.emit("tool_call_started", { traj_id: this.trajId, turn: Math.max(0, this.turn - 1), tool });
  }

  async toolFinished(tool = "", observationTokens = 0, ok = true) {
    await this.client.emit("tool_call_finished", {
      traj_id: this.trajId,
      turn: Math.max(0, this.turn - 1),
      tool,
      observation_tokens: observationTokens,
      ok,
    });
  }

  async finish(reward = null, status = "finished") {
    if (this.finished) return;
    this.finished = true;
    await this.client.emit("trajectory_finished", { traj_id: this.trajId, status, reward, turns: this.turn });
    if (this.loggedPrompt !== null) {
      this.loggedPrompt = null;
      await this.client.purgeContext(this.trajId); // no turn will refer to its prompts any more
    }
  }
}

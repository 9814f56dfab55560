"""Run AReaL's own multi-turn rollout workflow (areal.workflow.multi_turn, 1.0) on a Prorsa cluster through
`ProrsaWorkflow` / `ArealEngine`.

    .venv-trainers/bin/python -m tests.trainers.areal_workflow --nats URL

Runs in the trainers' environment (`make trainers`). AReaL's `MultiTurnWorkflow` retries a question until the
reward function accepts an answer (here: from the third attempt on), appending its "your answer is wrong" prompt
each time; every attempt is one `engine.agenerate`, so one episode is one three-turn Prorsa trajectory. Prints one
JSON line: the shapes of AReaL's trajectory tensors and what Prorsa served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

ACCEPT_FROM_TURN = 3


def reward_fn(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any
) -> float:
    """1.0 from the episode's third attempt on (AReaL runs this in a worker process: the count travels in the
    prompt, which grows by one amendment per attempt)."""
    return 1.0 if prompt.count("<|im_start|> assistant") >= ACCEPT_FROM_TURN else 0.0


async def main(url: str) -> dict[str, Any]:
    from areal.api.cli_args import GenerationHyperparameters
    from areal.workflow.multi_turn import MultiTurnWorkflow

    from prorsa.client import RolloutClient
    from prorsa.client.adapters import ProrsaWorkflow
    from tests.trainers.tiny_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    areal_workflow = MultiTurnWorkflow(
        reward_fn=reward_fn,
        gconfig=GenerationHyperparameters(max_new_tokens=20, temperature=1.0),
        tokenizer=tokenizer,
        max_turns=5,
        turn_discount=0.9,
    )
    client = await RolloutClient.connect(url, retry_after_s=60.0)
    await asyncio.sleep(1.2)  # one round of engine stats: prefix affinity from the second turn
    try:
        workflow = ProrsaWorkflow(areal_workflow, client, task="math")
        data = {"messages": [{"role": "user", "content": "t500 t501 t502 t503 t504"}]}
        # AReaL's executor would pass its own engine; ProrsaWorkflow runs the episode on Prorsa instead.
        result = await workflow.arun_episode(None, data)
    finally:
        await client.close()
    return {
        "client_id": client.client_id,
        "keys": sorted(result),
        "input_ids": list(result["input_ids"].shape),
        "loss_mask_ones": int(result["loss_mask"].sum()),
        "logprobs": list(result["logprobs"].shape),
        "versions": list(result["versions"].shape),
        "reward": float(result["rewards"].float().mean()),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nats", required=True)
    args = p.parse_args()
    print(json.dumps(asyncio.run(main(args.nats))))

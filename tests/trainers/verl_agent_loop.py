"""Run verl's own agent loops (verl.experimental.agent_loop, 0.9) on a Prorsa cluster through `VerlServerManager`.

    .venv-trainers/bin/python -m tests.trainers.verl_agent_loop --nats URL

Runs in the trainers' environment (`make trainers`), not the project's: verl and its imports live there. Prints one
JSON line: per loop, what verl's AgentLoopOutput holds and what Prorsa served.

- `SingleTurnAgentLoop`: one chat-template prompt, one generation.
- `ToolAgentLoop`: verl's ReAct loop with a tool. The simulated engines' output is noise, so the environment's tool
  parser (registered in verl's ToolParser registry, as any user parser is) reads every response as a call of the
  `step` tool; the tool answers with an observation; verl merges it through its Continuous Token builder and
  generates again, until `max_assistant_turns`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any


async def main(url: str, turns: int) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
    from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from prorsa.client import RolloutClient
    from prorsa.client.adapters import VerlServerManager
    from tests.trainers.tiny_tokenizer import build_tokenizer

    @ToolParser.register("prorsa_test_env")
    class EveryResponseCallsStep(ToolParser):
        async def extract_tool_calls(self, responses_ids: list[int], tools: Any = None) -> tuple[str, list]:
            return self.tokenizer.decode(responses_ids), [FunctionCall(name="step", arguments="{}")]

    class StepTool:
        """A BaseTool-shaped environment step: an observation of 40 words, reward 0.5 per call."""

        name = "step"
        tool_schema = OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {
                    "name": "step",
                    "description": "advance the environment",
                    "parameters": {"type": "object", "properties": {}, "required": []},
                },
            }
        )

        def __init__(self) -> None:
            self.calls = 0

        async def create(self, create_kwargs: Any = None) -> tuple[str, ToolResponse]:
            return f"env-{self.calls}", ToolResponse()

        async def execute(
            self, instance_id: str, parameters: dict, **kwargs: Any
        ) -> tuple[ToolResponse, float, dict]:
            self.calls += 1
            return ToolResponse(text=" ".join(f"t{1000 + i}" for i in range(40))), 0.5, {}

        async def release(self, instance_id: str) -> None:
            return None

    rollout = {
        "prompt_length": 2048,
        "response_length": 1024,
        "full_determinism": False,
        "multi_turn": {
            "max_user_turns": turns,
            "max_assistant_turns": turns,
            "max_parallel_calls": 1,
            "max_tool_response_length": 1024,
            "tool_response_truncate_side": "right",
            "format": "prorsa_test_env",
        },
    }
    config = DictConfigWrap(OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}}))
    data_config = DictConfigWrap(OmegaConf.create({"apply_chat_template_kwargs": {}}))
    tokenizer = build_tokenizer()
    client = await RolloutClient.connect(url, retry_after_s=60.0)
    await asyncio.sleep(1.2)  # one round of engine stats: prefix affinity from the second turn
    # verl's AgentLoopWorker sampling dict (agent_loop.py): no output budget; the server manager adds it.
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    common = {
        "trainer_config": config,
        "tokenizer": tokenizer,
        "processor": None,
        "dataset_cls": RLHFDataset,
        "data_config": data_config,
    }
    out: dict[str, Any] = {"client_id": client.client_id}
    try:
        single_mgr = VerlServerManager(client, task="math", max_tokens=16)
        single = SingleTurnAgentLoop(server_manager=single_mgr, **common)
        prompt = [{"role": "user", "content": "t300 t301 t302 t303"}]
        res = await single.run(dict(sampling), raw_prompt=prompt)
        (rid,) = single_mgr.trajectories
        await single_mgr.finish(rid, reward=1.0)
        out["single"] = _summary(res, single_mgr, rid)

        tool = StepTool()
        tool_mgr = VerlServerManager(client, task="coding", max_tokens=24)
        loop = ToolAgentLoop(server_manager=tool_mgr, tools=ToolListWrap([tool]), **common)
        res = await loop.run(dict(sampling), raw_prompt=[{"role": "user", "content": "t400 t401 t402"}])
        (rid,) = tool_mgr.trajectories
        traj = tool_mgr.trajectories[rid]
        out["tool"] = _summary(res, tool_mgr, rid) | {
            "tool_calls": tool.calls,
            "turn_scores": res.extra_fields.get("turn_scores"),
            "tool_rewards": res.extra_fields.get("tool_rewards"),
            "cached_tokens": [r.cached_tokens for r in traj.results],
            "prompt_tokens": [r.prompt_tokens for r in traj.results],
            "engines": [r.engine_id for r in traj.results],
            "prefill_engines": [r.prefill_engine for r in traj.results],
        }
        await tool_mgr.finish(rid, reward=sum(res.extra_fields.get("tool_rewards") or []))
    finally:
        await client.close()
    return out


def _summary(res: Any, mgr: Any, rid: str) -> dict[str, Any]:
    return {
        "request_id": rid,
        "prompt_ids": len(res.prompt_ids),
        "response_ids": len(res.response_ids),
        "response_mask_ones": sum(res.response_mask),
        "response_mask": len(res.response_mask),
        "logprobs": len(res.response_logprobs or []),
        "num_turns": res.num_turns,
        "num_cached_tokens": res.extra_fields.get("num_cached_tokens"),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nats", required=True)
    p.add_argument("--turns", type=int, default=3)
    args = p.parse_args()
    print(json.dumps(asyncio.run(main(args.nats, args.turns))))
    sys.exit(0)

"""Framework-free episode loops over `RolloutClient`, and where the trainer integrations live now.

- `MultiTurnWorkflow`: a Prorsa-native episode loop for trainers without a framework: `await workflow.run(client,
  prompt_ids)` runs model turn → environment step → ... → reward and returns the trajectory's record.
- verl and AReaL: `prorsa.trainers` (docs/trainers.md). `VerlServerManager`, `TokenOutput` and
  `sampling_from_dict` are still importable from here: they are `prorsa.trainers.verl`'s `ProrsaLLMClient` (which
  takes a `prorsa.trainers.connection.Connection`), `TokenOutput` and `sampling_from_dict`. The per-episode AReaL
  adapters (`ArealEngine`, `ProrsaWorkflow`) gave way to `prorsa.trainers.areal.ProrsaInferenceEngine`, the
  `InferenceEngine` AReaL's own `WorkflowExecutor` drives.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from prorsa.client.client import RolloutClient
from prorsa.client.stream import GenerateResult
from proto import SamplingParams

# Old names of what moved to prorsa.trainers.verl (loaded on first use, PEP 562).
_MOVED = {
    "VerlServerManager": "ProrsaLLMClient",
    "TokenOutput": "TokenOutput",
    "sampling_from_dict": "sampling_from_dict",
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module 'prorsa.client.adapters' has no attribute {name!r}")
    from prorsa.trainers import verl

    return getattr(verl, _MOVED[name])


class Environment(Protocol):
    """One agentic environment: turns the model's output into an observation, until done."""

    async def step(self, output_ids: list[int]) -> tuple[list[int], bool, float]:
        """(observation token ids to append, done, reward so far)."""
        ...


@dataclass
class EpisodeRecord:
    traj_id: str
    prompt_ids: list[int]
    turns: list[GenerateResult] = field(default_factory=list)
    reward: float = 0.0
    ids: list[int] = field(default_factory=list)  # the whole token sequence: prompt, outputs, observations
    loss_mask: list[int] = field(default_factory=list)  # 1 on model-generated tokens, 0 elsewhere


@dataclass
class MultiTurnWorkflow:
    """An AReaL-style workflow: `run()` rolls out one episode against `make_env()`'s environment."""

    make_env: Callable[[], Environment | Awaitable[Environment]]
    sampling: SamplingParams
    max_turns: int = 32
    task: str = ""
    tool: str = "env"

    async def run(
        self, client: RolloutClient, prompt_ids: list[int], policy_version: int = 0
    ) -> EpisodeRecord:
        env = self.make_env()
        if isinstance(env, Awaitable):
            env = await env
        traj = await client.start_trajectory(
            task=self.task, policy_version=policy_version, prompt_tokens=len(prompt_ids)
        )
        rec = EpisodeRecord(
            traj.traj_id, list(prompt_ids), ids=list(prompt_ids), loss_mask=[0] * len(prompt_ids)
        )
        for _ in range(self.max_turns):
            res = await traj.generate(rec.ids, self.sampling)
            rec.turns.append(res)
            rec.ids += res.token_ids
            rec.loss_mask += [1] * len(res.token_ids)
            await traj.tool_started(self.tool)
            observation, done, rec.reward = await env.step(res.token_ids)
            await traj.tool_finished(self.tool, observation_tokens=len(observation))
            if done:
                break
            rec.ids += observation
            rec.loss_mask += [0] * len(observation)
        await traj.finish(reward=rec.reward)
        return rec

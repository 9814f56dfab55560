"""Thin adapters shaped like the interfaces RL trainers already call, over `RolloutClient`.

- `VerlServerManager`: the shape of verl's `AsyncLLMServerManager.generate(request_id, *, prompt_ids,
  sampling_params)` used by its AgentLoop. verl passes the same `request_id` for every turn of one trajectory (that
  is how it keeps a trajectory's turns on one server for prefix caching); here it names the Prorsa trajectory, so
  affinity and lifecycle events follow. Returns an object with `token_ids` and `log_probs`, like verl's TokenOutput.
- `MultiTurnWorkflow`: the shape of an AReaL rollout workflow — `await workflow.run(client, prompt_ids)` runs one
  whole agentic episode (model turn → environment step → ... → reward) and returns the trajectory's record.

verl's sampling params are a dict (`temperature`, `top_p`, `top_k`, `max_tokens` or `max_new_tokens`, `logprobs`,
`seed`); unknown keys are ignored so trainer-specific extras do not break a turn.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from prorsa.client.client import RolloutClient, Trajectory
from prorsa.client.stream import GenerateResult
from proto import SamplingParams


@dataclass(frozen=True)
class TokenOutput:
    token_ids: list[int]
    log_probs: list[float] | None
    stop_reason: str = ""


def sampling_from_dict(params: dict[str, Any], default_max_tokens: int = 1024) -> SamplingParams:
    """verl/vLLM-style sampling dict → SamplingParams."""
    max_tokens = params.get("max_tokens") or params.get("max_new_tokens") or default_max_tokens
    return SamplingParams(
        max_tokens=int(max_tokens),
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=int(params.get("top_k", -1)),
        seed=params.get("seed"),
        logprobs=bool(params.get("logprobs", True)),
        ignore_eos=bool(params.get("ignore_eos", False)),
    )


class VerlServerManager:
    """`generate(request_id, prompt_ids=..., sampling_params=...)` as verl's AgentLoop calls it."""

    def __init__(self, client: RolloutClient, task: str = "", policy_version: int = 0) -> None:
        self.client = client
        self.task = task
        self.policy_version = policy_version
        self.trajectories: dict[str, Trajectory] = {}

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
    ) -> TokenOutput:
        if image_data is not None:
            raise NotImplementedError("multimodal inputs are not supported by Prorsa engines")
        traj = self.trajectories.get(request_id)
        if traj is None:
            traj = await self.client.start_trajectory(
                _safe_id(request_id), task=self.task, policy_version=self.policy_version
            )
            self.trajectories[request_id] = traj
        res = await traj.generate(list(prompt_ids), sampling_from_dict(sampling_params))
        return TokenOutput(res.token_ids, res.logprobs, res.finish_reason)

    async def finish(self, request_id: str, reward: float | None = None) -> None:
        """End a trajectory (verl has no such call; a Prorsa-aware AgentLoop adds it for exact lifecycles)."""
        traj = self.trajectories.pop(request_id, None)
        if traj is not None:
            await traj.finish(reward=reward)


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


def _safe_id(request_id: str) -> str:
    """A trajectory id usable as a subject-safe token, derived from the trainer's request id."""
    import re

    return re.sub(r"[^A-Za-z0-9_\-:]", "-", request_id)[:200] or "traj"

"""Adapters for RL trainers' own rollout code, over `RolloutClient`.

- `VerlServerManager`: what verl's agent loops (`verl.experimental.agent_loop`, 0.9) call as `self.server_manager`:
  `generate(request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None, audio_data=None,
  mm_processor_kwargs=None, **kwargs) -> TokenOutput`, the signature of verl's `LLMServerClient.generate`. verl
  passes the same `request_id` for every turn of one trajectory (that is how it keeps a trajectory's turns on one
  server for prefix caching); here it names the Prorsa trajectory, so affinity and lifecycle events follow.
  verl's sampling dict carries no output budget (its server manager adds the rollout's `response_length`), so the
  adapter takes that budget as `max_tokens`.
- `ArealEngine` / `ProrsaWorkflow`: AReaL (1.0) workflows call `await engine.agenerate(ModelRequest) ->
  ModelResponse` inside `RolloutWorkflow.arun_episode(engine, data)`. `ProrsaWorkflow(workflow, client)` is itself
  a rollout workflow: each episode gets an `ArealEngine` bound to one Prorsa trajectory, runs the wrapped AReaL
  workflow on it unchanged, and finishes the trajectory with the episode's reward.
- `MultiTurnWorkflow`: a Prorsa-native episode loop for trainers without a framework: `await workflow.run(client,
  prompt_ids)` runs model turn → environment step → ... → reward and returns the trajectory's record.

verl's sampling params are a dict (`temperature`, `top_p`, `top_k`, `repetition_penalty`, `max_tokens` or
`max_new_tokens`, `logprobs`, `seed`; vLLM's `presence_penalty`, `frequency_penalty` and `min_tokens` are taken too);
unknown keys are ignored so trainer-specific extras do not break a turn. Multimodal inputs are refused
(NotImplementedError): Prorsa engines take token ids only.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from prorsa.client.client import RolloutClient, Trajectory
from prorsa.client.stream import GenerateResult
from proto import SamplingParams

# verl's TokenOutput.stop_reason: "completed", "aborted", or None (unknown).
_VERL_STOP_REASON = {"stop": "completed", "length": "completed", "abort": "aborted", "error": "aborted"}
# AReaL's ModelResponse.stop_reason: "length" | "stop" | "tool_calls" | "abort".
_AREAL_STOP_REASON = {"stop": "stop", "length": "length", "abort": "abort", "error": "abort"}


@dataclass(frozen=True)
class TokenOutput:
    """The fields of verl's `TokenOutput` (verl.workers.rollout.replica) that its agent loops read."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None  # MoE routing replay: not recorded by Prorsa engines
    stop_reason: str | None = None  # "completed" | "aborted" | None
    num_preempted: int | None = None  # not measured
    extra_fields: dict[str, Any] = field(default_factory=dict)  # Prorsa's per-turn facts, for metrics


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
        stop_token_ids=[int(t) for t in params.get("stop_token_ids") or []],
        ignore_eos=bool(params.get("ignore_eos", False)),
        presence_penalty=float(params.get("presence_penalty", 0.0)),
        frequency_penalty=float(params.get("frequency_penalty", 0.0)),
        repetition_penalty=float(params.get("repetition_penalty", 1.0)),
        min_tokens=int(params.get("min_tokens", 0)),
    )


def _refuse_multimodal(**inputs: Any) -> None:
    given = [name for name, value in inputs.items() if value is not None and value != []]
    if given:
        raise NotImplementedError(f"Prorsa engines take token ids only; got {', '.join(given)}")


class VerlServerManager:
    """`generate(request_id, *, prompt_ids, sampling_params, ...)` as verl's agent loops call it."""

    def __init__(
        self, client: RolloutClient, task: str = "", policy_version: int = 0, max_tokens: int = 1024
    ) -> None:
        self.client = client
        self.task = task
        self.policy_version = policy_version
        self.max_tokens = max_tokens  # verl's rollout.response_length: the budget when sampling has none
        self.trajectories: dict[str, Trajectory] = {}

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """One turn of trajectory `request_id`. `kwargs` takes verl's extras (`priority`, `mm_processor_output`):
        a priority has no meaning on the shared work queue and is ignored. Raises NotImplementedError on
        multimodal inputs, else what `Trajectory.generate` raises."""
        _refuse_multimodal(
            image_data=image_data,
            video_data=video_data,
            audio_data=audio_data,
            mm_processor_output=kwargs.get("mm_processor_output"),
        )
        traj = self.trajectories.get(request_id)
        if traj is None:
            traj = await self.client.start_trajectory(
                _safe_id(request_id), task=self.task, policy_version=self.policy_version
            )
            self.trajectories[request_id] = traj
        res = await traj.generate(list(prompt_ids), sampling_from_dict(sampling_params, self.max_tokens))
        return TokenOutput(
            token_ids=res.token_ids,
            log_probs=res.logprobs,
            stop_reason=_VERL_STOP_REASON.get(res.finish_reason),
            extra_fields={"num_cached_tokens": res.cached_tokens, "global_steps": res.policy_version},
        )

    async def finish(self, request_id: str, reward: float | None = None) -> None:
        """End a trajectory (verl has no such call; a Prorsa-aware AgentLoop adds it for exact lifecycles)."""
        traj = self.trajectories.pop(request_id, None)
        if traj is not None:
            await traj.finish(reward=reward)


def sampling_from_gconfig(gconfig: Any) -> SamplingParams:
    """AReaL `GenerationHyperparameters` → SamplingParams. Raises ValueError for n_samples != 1 (AReaL's
    workflows send one request per sample)."""
    if getattr(gconfig, "n_samples", 1) != 1:
        raise ValueError(f"one request per sample: n_samples must be 1, got {gconfig.n_samples}")
    return SamplingParams(
        max_tokens=int(gconfig.max_new_tokens),
        temperature=0.0 if gconfig.greedy else float(gconfig.temperature),
        top_p=float(gconfig.top_p),
        top_k=int(gconfig.top_k),
        stop_token_ids=[int(t) for t in gconfig.stop_token_ids if t is not None],
        ignore_eos=bool(gconfig.ignore_eos),
    )


class ArealEngine:
    """The `agenerate` of AReaL's `InferenceEngine`, bound to one Prorsa trajectory (one episode).

    Every `agenerate` of the episode is one turn of the trajectory; `finish` ends it. The response is AReaL's own
    `areal.api.io_struct.ModelResponse`, imported when first called: only a process running AReaL calls this.
    """

    def __init__(self, client: RolloutClient, task: str = "", policy_version: int = 0) -> None:
        self.client = client
        self.task = task
        self.policy_version = policy_version
        self.trajectory: Trajectory | None = None

    async def agenerate(self, req: Any) -> Any:
        """One model turn on `req.input_ids` (the whole context) with `req.gconfig`; returns a ModelResponse.
        Raises NotImplementedError on image inputs, ValueError for n_samples != 1."""
        from areal.api.io_struct import ModelResponse

        _refuse_multimodal(image_data=req.image_data or None, vision_msg_vllm=req.vision_msg_vllm)
        if self.trajectory is None:
            self.trajectory = await self.client.start_trajectory(
                task=self.task, policy_version=self.policy_version, prompt_tokens=len(req.input_ids)
            )
        res = await self.trajectory.generate(list(req.input_ids), sampling_from_gconfig(req.gconfig))
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=res.token_ids,
            output_logprobs=res.logprobs if res.logprobs is not None else [0.0] * len(res.token_ids),
            output_versions=[res.policy_version] * len(res.token_ids),
            stop_reason=_AREAL_STOP_REASON.get(res.finish_reason, "stop"),
            tokenizer=req.tokenizer,
            latency=res.e2e_s,
            ttft=res.ttft_s,
        )

    async def finish(self, reward: float | None = None, status: str = "finished") -> None:
        if self.trajectory is not None:
            await self.trajectory.finish(reward=reward, status=status)


@dataclass
class ProrsaWorkflow:
    """An AReaL rollout workflow (`arun_episode(engine, data)`) that runs `workflow`'s episodes on Prorsa.

    The engine AReaL's executor passes in is not used: each episode runs on a fresh `ArealEngine`, one Prorsa
    trajectory, finished with the episode's mean reward (`rewards` of the result), or aborted when the wrapped
    workflow rejects the episode (returns None) or raises.
    """

    workflow: Any  # an AReaL RolloutWorkflow
    client: RolloutClient
    task: str = ""
    policy_version: int = 0

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        episode = ArealEngine(self.client, self.task, self.policy_version)
        try:
            result = await self.workflow.arun_episode(episode, data)
        except BaseException:
            await episode.finish(status="aborted")
            raise
        if result is None:
            await episode.finish(status="aborted")
            return None
        rewards = result.get("rewards") if isinstance(result, dict) else None
        reward = float(rewards.float().mean()) if rewards is not None else None
        await episode.finish(reward=reward if reward is None or math.isfinite(reward) else None)
        return result


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

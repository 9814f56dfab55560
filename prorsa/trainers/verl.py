"""verl (0.9) on Prorsa: the LLM client its agent loops call. This module imports no verl, so it also serves a
trainer that calls verl-shaped code without verl installed.

verl has three extension points for a rollout backend, and Prorsa fills each:
- `ProrsaLLMClient` (here): what `AgentLoopManager(config, llm_client=...)` pickles into every `AgentLoopWorker`
  Ray actor and what each agent loop calls as its `server_manager`: `generate(request_id, *, prompt_ids,
  sampling_params, image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None, **kwargs) ->
  TokenOutput`, the signature of verl's `LLMServerClient.generate`. It holds a `Connection`, not a connection: each
  worker process connects once per event loop, on its first turn.
- `ProrsaAgentLoop` (`prorsa.trainers.verl_agent_loop`): an agent loop for verl's registry that runs any other
  registered loop (`single_turn_agent`, `tool_agent`, a user's) as one Prorsa episode and finishes every trajectory
  it opened, with the loop's reward, or as aborted when the loop raises. verl has no "trajectory finished" call;
  without it every trajectory would sit in `tool_call` until the tracker's timeout and inflate the demand the
  allocator acts on.
- `ProrsaReplica` (`prorsa.trainers.verl_replica`): verl's rollout replica for `rollout.name=prorsa`.

A trajectory. verl passes the same `request_id` for every turn of one trajectory (that is how its own client keeps
a trajectory on one server for prefix caching); here it names the Prorsa trajectory, so affinity and the lifecycle
follow. The Prorsa trajectory id is the request id made subject-safe plus a short nonce, since verl reuses request
ids across steps (`full_determinism`: `det-<priority>`). Inside a `ProrsaAgentLoop` the trajectories belong to that
episode; outside one they are kept per client until `finish(request_id)`.

Versions. Every token comes back with the policy version that produced it (`GenerateResult.token_versions`): the
TokenOutput's `extra_fields` carry them (`token_versions`) with verl's own `global_steps` (the last token's version),
`min_global_steps` and `max_global_steps`, which verl's fully asynchronous trainer reads for staleness.

Sampling. verl's dict (`temperature`, `top_p`, `top_k`, `repetition_penalty`, `max_tokens` or `max_new_tokens`,
`logprobs`, `seed`, vLLM's other penalties and `min_tokens`) maps onto `SamplingParams`; verl's dict carries no
output budget (its own client adds `rollout.response_length`), so the client's `max_tokens` (default: the config's
`response_length`) is that budget. `n` or `best_of` above 1 raise ValueError (one request per sample).
Multimodal inputs raise NotImplementedError: Prorsa engines take token ids.
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proto import SamplingParams

if TYPE_CHECKING:
    from prorsa.client.client import Trajectory
    from prorsa.client.stream import GenerateResult
    from prorsa.trainers.connection import Connection

NOT_MODEL = -1  # the version of a response token the model did not produce
# verl's TokenOutput.stop_reason: "completed", "aborted", or None (unknown).
VERL_STOP_REASON = {"stop": "completed", "length": "completed", "abort": "aborted", "error": "aborted"}

# Keys of verl's (vLLM-style) sampling dict that Prorsa engines honour only at their neutral value.
_NEUTRAL = {"n": 1, "best_of": 1}


@dataclass(frozen=True)
class TokenOutput:
    """The fields of verl's `TokenOutput` (verl.workers.rollout.replica) that its agent loops read."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None  # MoE routing replay: not recorded by Prorsa engines
    stop_reason: str | None = None  # "completed" | "aborted" | None
    num_preempted: int | None = None  # not measured
    extra_fields: dict[str, Any] = field(default_factory=dict)  # token_versions, global_steps, cache hits


def sampling_from_dict(params: dict[str, Any], default_max_tokens: int = 1024) -> SamplingParams:
    """verl/vLLM-style sampling dict → SamplingParams: `temperature`, `top_p`, `top_k`, `max_tokens` or
    `max_new_tokens`, `logprobs`, `seed`, `stop_token_ids`, `ignore_eos`, and the sampler's `repetition_penalty`,
    `presence_penalty`, `frequency_penalty`, `min_tokens`. Raises ValueError for `n` or `best_of` above 1 (one
    request per sample). Other keys are trainer-specific extras and are ignored."""
    for key, neutral in _NEUTRAL.items():
        value = params.get(key)
        if value is not None and float(value) != float(neutral):
            raise ValueError(
                f"sampling_params[{key!r}] = {value!r}: one request per sample (only {neutral!r})"
            )
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


def refuse_multimodal(**inputs: Any) -> None:
    """Raises NotImplementedError naming every multimodal input given (Prorsa engines take token ids only)."""
    given = [name for name, value in inputs.items() if value is not None and value != [] and value != {}]
    if given:
        raise NotImplementedError(f"Prorsa engines take token ids only; got {', '.join(given)}")


def trajectory_id(request_id: str) -> str:
    """A cluster-unique trajectory id for verl's `request_id`: subject-safe, recognisable, with a nonce."""
    safe = re.sub(r"[^A-Za-z0-9_\-:]", "-", str(request_id))[:180] or "traj"
    return f"{safe}-{uuid.uuid4().hex[:8]}"


@dataclass
class Episode:
    """One agent-loop run: the trajectories it opened (by verl request id) and the versions of the tokens the model
    produced, in the order the turns returned."""

    trajectories: dict[str, Trajectory] = field(default_factory=dict)
    token_versions: list[int] = field(default_factory=list)


# The episode of the running agent loop. Set by `ProrsaAgentLoop.run`; asyncio copies it into every task the loop
# spawns, so concurrent turns of one episode land in the same `Episode`, and concurrent episodes never meet.
CURRENT_EPISODE: ContextVar[Episode | None] = ContextVar("prorsa_verl_episode", default=None)


class ProrsaLLMClient:
    """verl's `llm_client` / `server_manager` on Prorsa (see the module doc). Picklable."""

    def __init__(
        self,
        connection: Connection,
        *,
        task: str = "",
        max_tokens: int = 1024,
        policy_version: int = 0,
    ) -> None:
        """`max_tokens`: the output budget when verl's sampling dict names none (its `rollout.response_length`);
        `policy_version`: the version stamped on trajectory lifecycle events."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be ≥ 1, got {max_tokens}")
        self.connection = connection
        self.task = task
        self.max_tokens = max_tokens
        self.policy_version = policy_version
        self.trajectories: dict[str, Trajectory] = {}  # outside any episode, until finish(request_id)

    @classmethod
    def from_config(cls, config: Any, connection: Connection | None = None) -> ProrsaLLMClient:
        """From verl's trainer config: the budget is `actor_rollout_ref.rollout.response_length`; the cluster is
        `connection`, else `rollout.custom.prorsa` (`nats_url`, `namespace`, `task`), else the environment."""
        from prorsa.trainers.settings import prorsa_settings

        rollout = config.actor_rollout_ref.rollout
        settings = prorsa_settings(rollout)
        return cls(
            connection or settings.connection(),
            task=settings.task,
            max_tokens=int(rollout.response_length),
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["trajectories"] = {}  # bound to this process's clients: a copy starts its own
        return state

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
        """One turn of trajectory `request_id` on the whole context `prompt_ids`. `kwargs` takes verl's extras
        (`priority`, `mm_processor_output`): a priority has no meaning on the shared work queue and is ignored.
        Raises NotImplementedError on multimodal inputs, ValueError on sampling Prorsa cannot honour, else what
        `Trajectory.generate` raises."""
        refuse_multimodal(
            image_data=image_data,
            video_data=video_data,
            audio_data=audio_data,
            mm_processor_output=kwargs.get("mm_processor_output"),
        )
        sampling = sampling_from_dict(sampling_params, self.max_tokens)
        episode = CURRENT_EPISODE.get()
        book = episode.trajectories if episode is not None else self.trajectories
        traj = book.get(request_id)
        if traj is None:
            client = await self.connection.client()
            traj = await client.start_trajectory(
                trajectory_id(request_id),
                task=self.task,
                policy_version=self.policy_version,
                prompt_tokens=len(prompt_ids),
            )
            book[request_id] = traj
        res = await traj.generate(list(prompt_ids), sampling)
        if episode is not None:
            episode.token_versions += res.token_versions
        return token_output(res, traj.traj_id)

    async def finish(self, request_id: str, reward: float | None = None, status: str = "finished") -> None:
        """End a trajectory opened outside any episode (inside one, `ProrsaAgentLoop` finishes it)."""
        traj = self.trajectories.pop(request_id, None)
        if traj is not None:
            await traj.finish(reward=reward, status=status)

    async def finish_episode(
        self, episode: Episode, reward: float | None = None, status: str = "finished"
    ) -> None:
        """End every trajectory of `episode` (each once: a finished trajectory ignores a second finish)."""
        for traj in episode.trajectories.values():
            await traj.finish(reward=reward, status=status)


def token_output(res: GenerateResult, traj_id: str) -> TokenOutput:
    """verl's view of one served turn: ids, logprobs, stop reason, and per-token versions in `extra_fields`."""
    versions = list(res.token_versions)
    last = versions[-1] if versions else res.policy_version
    return TokenOutput(
        token_ids=res.token_ids,
        log_probs=res.logprobs,
        stop_reason=VERL_STOP_REASON.get(res.finish_reason),
        extra_fields={
            "num_cached_tokens": res.cached_tokens,
            "global_steps": last,
            "min_global_steps": min(versions, default=last),
            "max_global_steps": max(versions, default=last),
            "token_versions": versions,
            "prorsa_trajectory": traj_id,
        },
    )


def response_versions(response_mask: list[int], token_versions: list[int], agent: str = "") -> list[int]:
    """The version of each response token: the model's tokens (mask 1) take the episode's token versions in order,
    the others `NOT_MODEL`. A response truncated to verl's `response_length` uses only the first versions. Raises
    RuntimeError when the response holds more model tokens than were served (the loop rewrote its tokens: the
    versions could not be placed truthfully)."""
    model_tokens = sum(1 for m in response_mask if m)
    if model_tokens > len(token_versions):
        raise RuntimeError(
            f"agent loop {agent!r}: its response holds {model_tokens} model tokens but Prorsa served "
            f"{len(token_versions)}: per-token versions cannot be aligned"
        )
    served = iter(token_versions)
    return [next(served) if m else NOT_MODEL for m in response_mask]

"""What the engine agent needs from an inference engine: the `Backend` protocol and the values it passes around.

Two backends implement it: `backends.sim_backend.SimBackend` (the performance model run in wall-clock time) and
`backends.vllm_backend.VllmBackend` (real vLLM `AsyncLLM`, token ids in and out, KV over vLLM's KV connector).
The agent never looks behind the protocol, so everything role- and queue-related (pulling, acking, streaming,
migration, events) is shared by both.

Token positions. A request's *context* is `prompt_token_ids + resume_token_ids` (`prompt_len + len(resume)` tokens;
the simulated backend accepts empty ids and counts `prompt_len`). Its output is the whole turn: at most
`sampling.max_tokens` tokens, the first `len(resume_token_ids)` of which were already streamed elsewhere (a migrated
request). So every call below generates output positions `len(resume)`, `len(resume) + 1`, ... and stops at
`max_tokens` in all, a stop token, or the model length.

- `generate(request)`: prefill the context locally, then decode. Streams the output from position `len(resume)`.
- `prefill(request)`: prefill for a remote decode. Samples the token at position `len(resume)` and keeps the KV
  where a decode engine can pull it (`kv_transfer_params`, e.g. vLLM's `do_remote_decode` result).
- `decode(handoff)`: pull the KV named by `handoff.kv_transfer_params`, treat `handoff.first_token_id` as already
  sampled (position `len(resume)`; the agent streams it itself) and stream from position `len(resume) + 1`.
  Raises `KvUnavailable` (at the first `__anext__`, before yielding) when the KV is gone: the agent re-prefills.

Streams are async iterators of `GenChunk`. Each chunk carries the tokens produced since the previous chunk (a
backend may merge steps when the consumer is slow); the last one has `finished=True`. After `abort(request_id)` a
stream ends (`StopAsyncIteration`) without a final chunk, or yields one with `finish_reason="abort"`; the agent
ignores anything after it asked for the abort. A consumer that stops iterating early (closes the iterator) must
free the request as `abort` would.

Weights. `policy_version` is the version whose weights serve from now on; `reload_weights` (a checkpoint) and
`receive_weights` (tensors through the engine's weight-transfer API) replace them between two engine steps: a running
request is frozen meanwhile and goes on under the new weights, and every chunk names the version that sampled its
tokens (`GenChunk.policy_version`; a backend splits a chunk rather than let it span two). `pause_generation(reason)`
freezes every request between two steps until the last reason is lifted (`resume_generation`): a weight load and a
trainer's pause may overlap.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from proto import DecodeHandoff, GenerateRequest, SamplingParams


class BackendError(RuntimeError):
    """The engine failed a request for a reason of its own (not the request's fault)."""


class KvUnavailable(BackendError):
    """A decode handoff's KV can no longer be pulled (freed or expired on the prefill engine): re-prefill it."""


class EngineDead(BackendError):
    """The engine itself is gone (vLLM's engine-core process died: `EngineDeadError`); no request will run on it
    again. The agent hands on what it holds and exits, so its supervisor starts a fresh one."""


class RequestAborted(BackendError):
    """`prefill()` was interrupted by `abort(request_id)`."""


@dataclass(frozen=True, slots=True)
class PrefillInfo:
    """Accounting of one local prefill (first chunk of `generate`)."""

    new_tokens: int  # context tokens computed
    cached_tokens: int  # context tokens served from the prefix cache
    prefill_s: float  # time the prefill took (the backend's own clock: virtual seconds on the sim backend)


@dataclass(frozen=True, slots=True)
class GenChunk:
    """Output tokens produced since the previous chunk of one request."""

    token_ids: list[int]  # new output token ids, in order (may be empty on a final chunk)
    logprobs: list[float] | None  # logprob of each sampled token, when `sampling.logprobs`; else None
    finished: bool = False  # the last chunk of the stream
    finish_reason: str = ""  # on the final chunk: "length" (max_tokens or model length) | "stop" | "abort"
    prefill: PrefillInfo | None = None  # first chunk of `generate` only
    # Per token, the request's `sampling.top_logprobs` most likely (token id, logprob), the most likely first;
    # None when not asked for.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # The weights version that sampled these tokens (None: the backend's now).
    policy_version: int | None = None


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """Outcome of `prefill()`: the first output token and where its KV lives."""

    first_token_id: int
    first_logprob: float | None
    kv_transfer_params: dict[str, Any] | None  # passed verbatim to the decode engine in the DecodeHandoff
    new_tokens: int
    cached_tokens: int
    prefill_s: float
    finished: bool = (
        False  # the first token ends the request (stop token, or one token left): no decode needed
    )
    finish_reason: str = ""  # when finished
    # The first token's alternatives (as GenChunk's top_logprobs); None when not asked for.
    first_top_logprobs: list[tuple[int, float]] | None = None
    # The weights version that sampled the first token (None: the backend's now).
    policy_version: int | None = None


@dataclass(frozen=True, slots=True)
class BackendStats:
    """The engine's load, read by the agent for stats and admission (cheap: called often)."""

    running: int  # sequences in the running batch
    waiting: int  # sequences accepted but not running yet (queued prefill, KV transfer, no batch slot)
    # KV held by admitted sequences; evictable prefix-cache blocks count as free (as vLLM counts them).
    kv_used_tokens: int
    kv_capacity_tokens: int
    max_batch: int  # most sequences in one batch (vLLM max_num_seqs)
    prefix_cache_tokens: int = 0  # prompt tokens held for reuse by later turns (0 = the engine does not say)
    # True when `kv_used_tokens` is the engine's own measurement of the KV in use (vLLM's block usage, every
    # data-parallel rank, blocks pinned for unclaimed handoffs included): decode admission then reads it instead
    # of reserving each sequence's whole context + max_tokens (see measured_capacity.py).
    kv_measured: bool = False
    preemptions: int = 0  # cumulative sequences the engine preempted for want of KV (measured engines)
    restart_roles: tuple[str, ...] = ()  # roles a switch to which restarts the engine (another layout)


@runtime_checkable
class Backend(Protocol):
    """An inference engine as the agent sees it (see the module docstring for positions and streams)."""

    name: str  # "sim" | "vllm": reported in EngineStats.backend
    max_model_len: int  # context + output tokens a sequence may reach
    # The `services.runtime.clock.Clock` its stamps and sleeps are on; the agent runs on the same one. (Typed Any:
    # this module is a pure core, and the clock module reads time.)
    clock: Any

    async def start(self) -> None:
        """Load the model / start the engine loop. Raises BackendError if the engine cannot start."""

    async def close(self) -> None:
        """Stop the engine and free its resources (idempotent)."""

    async def check_alive(self) -> None:
        """The liveness probe: returns while the engine can serve. Raises EngineDead once it cannot."""

    def sampling_problem(self, sampling: SamplingParams) -> str:
        """Why this engine can never sample a turn as `sampling` asks ("" if it can): the agent fails such a turn
        with the reason instead of running it (e.g. logprobs of another kind than the engine returns)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenChunk]:
        """Prefill locally and decode; the first chunk carries `prefill` accounting."""
        ...

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        """Prefill for a remote decode. Raises RequestAborted after `abort`, BackendError on engine failure."""
        ...

    def decode(self, handoff: DecodeHandoff) -> AsyncIterator[GenChunk]:
        """Decode a request prefilled elsewhere, from the token after `handoff.first_token_id`.

        Raises KvUnavailable before the first chunk when the KV cannot be pulled."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (queued, prefilling, decoding); unknown ids are ignored."""

    async def wait_output(self, request_id: str, max_wait_s: float) -> None:
        """Pause between two chunks of a request's stream, so tokens accumulate (wall seconds); a backend that
        can tell may return early once the request has ended."""

    def stats(self) -> BackendStats:
        """Current load."""
        ...

    def expected_output_tokens(self, request: GenerateRequest) -> int:
        """Whole-turn output length the engine expects (an upper bound where it cannot know: max_tokens capped
        by the model length). The agent uses it to decide which decodes finish within a drain timeout."""
        ...

    # The weights version it serves now (set by the loads below; the agent sets the start version).
    policy_version: int

    async def reload_weights(self, version: int, weights_path: str) -> None:
        """Serve the weights at `weights_path` ("" = reload from the model path) as `version` from the next engine
        step on; running requests go on under them. Raises BackendError on failure (the old weights stay)."""

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's weight-transfer group (NCCL: a rendezvous the trainer joins at the same time). Raises
        BackendError where the engine cannot (no `weight_transfer_config`, a failed rendezvous)."""

    async def receive_weights(self, version: int, transfer: dict[str, Any]) -> None:
        """As `reload_weights`, with the weights sent as tensors through the engine's weight-transfer API
        (`transfer["update_info"]`: the backend's update info). Raises BackendError where the engine cannot (it has
        not joined the group)."""

    async def pause_generation(self, reason: str) -> None:
        """Freeze every request between two engine steps (and admit none) until `resume_generation(reason)` lifts
        the last reason. Idempotent per reason."""

    async def resume_generation(self, reason: str) -> None:
        """Lift `reason`; the engine runs again once no reason is left. Unknown reasons are ignored."""

    async def set_role(self, role: str) -> None:
        """Reconfigure for a new role ("prefill" | "decode" | "mixed") once drained: the agent calls it between
        the drain and the ack of a role switch. The sim backend pays the profile's modelled switch cost."""

"""The simulated engine backend: `SimScheduler` run in real time, `speedup` virtual seconds per wall second.

Time. Every clock reading and sleep goes through the backend's `Clock` (`services.runtime.clock`: scaled seconds
= wall seconds × the time scale), which the agent shares. A modelled (virtual) duration `d` lasts `d / speedup` wall
seconds, i.e. `d × scale / speedup` scaled seconds; `speedup` defaults to the time scale, so with the scale set the
engine's virtual seconds *are* the scaled seconds every service measures (prefill_s, ttft_s, e2e_s, tokens/s).

The engine loop plans a step, waits its modelled duration, applies it and wakes the streams of the sequences that
produced tokens. Waits are paced against a deadline carried from step to step, so Python overhead and late
wake-ups inside a busy period are absorbed by the next waits instead of slowing the modelled engine down (a backlog
is never carried across an idle period, and one beyond `MAX_LAG_WALL_S` is dropped rather than replayed as a burst).
A decode step is 10-25 ms virtual, under a millisecond of wall time at speed-ups of 50+, so pure decode steps are
coalesced (`SimScheduler.plan`'s budget): one loop iteration covers up to `coalesce_wall_s` of wall time, and work
that arrives meanwhile joins at the end of the block (an admission delay of at most that quantum).
KV transfer (decode side) is a wait of `kv_transfer_time_s` outside the step loop, as a real KV connector moves
data while the engine keeps stepping.

KV handed to a decode engine is named by `kv_transfer_params = {"sim_engine": <engine>, "sim_expires_s": <Unix
time, scaled seconds (Clock.now_s)>}`: a prefill engine keeps a handed-off prompt's KV for `kv_ttl_s` virtual
seconds (vLLM's NIXL connector frees unclaimed blocks after a timeout, `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480 s by
default); a decode that comes later finds it gone (`KvUnavailable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

from proto import DecodeHandoff, GenerateRequest
from services.engine_agent.backend import (
    BackendError,
    BackendStats,
    GenChunk,
    KvUnavailable,
    PrefillInfo,
    PrefillResult,
    RequestAborted,
)
from services.engine_agent.backends.sim_scheduler import (
    DEFAULT_MAX_MODEL_LEN,
    SeqMode,
    SimScheduler,
    SimSeq,
    context_tokens,
    output_end,
)
from services.engine_agent.backends.sim_tokens import QWEN3_VOCAB_SIZE, SimTokens
from services.runtime import perf_model as pm
from services.runtime.clock import Clock, scale_from_env
from services.runtime.logging import get_logger
from services.runtime.perf_model import ModelProfile

DEFAULT_KV_TTL_S = 480.0
DEFAULT_SPEEDUP = (
    10.0  # virtual seconds per wall second when neither `speedup` nor $PRORSA_TIME_SCALE is given
)
# Wall time one engine-loop iteration may cover by coalescing decode steps: long enough that a loop trip (~0.1-0.5 ms
# of Python on a loaded machine) is a small fraction of it, short enough to delay an arrival by little.
DEFAULT_COALESCE_WALL_S = 0.005
MAX_LAG_WALL_S = 0.1  # the engine loop catches up at most this far behind its deadline (a stalled event loop)


def resolve_speedup(speedup: float | None, time_scale: float | None, engine_id: str = "") -> float:
    """The speed-up to run at: `speedup` if given (warning when a time scale is set and differs: the engine's
    virtual seconds then differ from the scaled seconds other services measure), else `time_scale` if set (not
    None), else `DEFAULT_SPEEDUP`."""
    if speedup is None:
        return DEFAULT_SPEEDUP if time_scale is None else time_scale
    if time_scale is not None and not math.isclose(speedup, time_scale, rel_tol=1e-9):
        get_logger("engine_agent", engine_id or "sim").warning(
            "speedup_differs_from_time_scale", speedup=speedup, time_scale=time_scale
        )
    return speedup


class SimBackend:
    """`Backend` over the performance model (see the module docstring)."""

    name = "sim"

    def __init__(
        self,
        profile: ModelProfile,
        engine_id: str,
        *,
        role: str = "mixed",
        speedup: float | None = None,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        vocab_size: int = QWEN3_VOCAB_SIZE,
        kv_ttl_s: float = DEFAULT_KV_TTL_S,
        weight_update_s: float | None = None,
        coalesce_wall_s: float = DEFAULT_COALESCE_WALL_S,
        clock: Clock | None = None,
    ) -> None:
        """`speedup`: virtual seconds per wall second (None: see `resolve_speedup`). `clock`: the scaled clock
        (None: $PRORSA_TIME_SCALE's, read now; unset, it sets no speed-up). `coalesce_wall_s`: wall time one
        coalesced block of decode steps may last (0: step one at a time). Raises ValueError on bad values."""
        if clock is None:
            scale = scale_from_env()  # None: no scale chosen, the default speed-up applies
            clock = Clock(1.0 if scale is None else scale)
        else:
            scale = clock.time_scale
        speedup = resolve_speedup(speedup, scale, engine_id)
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if coalesce_wall_s < 0:
            raise ValueError(f"coalesce_wall_s must be >= 0, got {coalesce_wall_s}")
        self.profile = profile
        self.engine_id = engine_id
        self.clock = clock
        self.speedup = speedup
        self.coalesce_wall_s = coalesce_wall_s
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.kv_ttl_s = kv_ttl_s
        # The profile has no weight-update cost; an in-place reload is modelled like a role switch (flush + warm-up
        # with the new weights already on the hosts) unless given.
        self.weight_update_s = pm.role_switch_time_s(profile) if weight_update_s is None else weight_update_s
        self.sched = SimScheduler(profile, role, max_model_len)
        self._signals: dict[str, asyncio.Event] = {}
        self._streaming: dict[str, SimSeq] = {}  # sequences whose stream a consumer is reading
        self._done_events: dict[str, asyncio.Event] = {}  # set when the sequence ends (see wait_output)
        self._futures: dict[str, asyncio.Future[PrefillResult]] = {}
        self._wake = asyncio.Event()
        self._deadline_s: float | None = None  # scaled monotonic time the current step ends; None when idle
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._engine_loop(), name=f"sim-engine-{self.engine_id}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for rid in list(self._signals) + list(self._futures):
            await self.abort(rid)

    # -- the Backend protocol ------------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenChunk]:
        seq = self._seq(request, "generate", context_tokens(request), len(request.resume_token_ids))
        if seq.pos >= seq.end:
            yield GenChunk(
                [], None, finished=True, finish_reason=seq.end_reason, prefill=PrefillInfo(0, 0, 0.0)
            )
            return
        self._check_running()
        self._signals[seq.request_id] = asyncio.Event()
        self.sched.add_prefill(seq)
        self._wake.set()
        async for chunk in self._stream(seq):
            yield chunk

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        seq = self._seq(request, "prefill", context_tokens(request), len(request.resume_token_ids))
        if seq.pos >= seq.end:
            raise BackendError(f"request {request.request_id}: nothing left to generate")
        self._check_running()
        fut: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        self._futures[seq.request_id] = fut
        self.sched.add_prefill(seq)
        self._wake.set()
        try:
            return await fut
        finally:
            self._futures.pop(seq.request_id, None)
            if not seq.done:
                self.sched.remove(seq.request_id)

    async def decode(self, handoff: DecodeHandoff) -> AsyncIterator[GenChunk]:
        request = handoff.request
        # Context once the KV is here: the prompt plus the first token the prefill engine sampled.
        seq = self._seq(request, "decode", context_tokens(request) + 1, len(request.resume_token_ids) + 1)
        if seq.pos >= seq.end:
            yield GenChunk([], None, finished=True, finish_reason=seq.end_reason)
            return
        self._check_kv(handoff)
        self._check_running()
        self._signals[seq.request_id] = asyncio.Event()
        self.sched.add_incoming(seq)
        try:
            await self._sleep_virtual(pm.kv_transfer_time_s(self.profile, context_tokens(request)))
        except asyncio.CancelledError:
            self.sched.remove(seq.request_id)
            self._signals.pop(seq.request_id, None)
            raise
        if not self.sched.arrive(seq.request_id):
            self._signals.pop(seq.request_id, None)
            return  # aborted during the transfer
        self._wake.set()
        async for chunk in self._stream(seq):
            yield chunk

    async def abort(self, request_id: str) -> None:
        seq = self.sched.remove(request_id)
        if seq is not None:
            seq.aborted = True
        signal = self._signals.get(request_id)
        if signal is not None:
            signal.set()
        done = self._done_events.get(request_id)
        if done is not None:
            done.set()
        fut = self._futures.get(request_id)
        if fut is not None and not fut.done():
            fut.set_exception(RequestAborted(f"request {request_id} aborted"))

    def stats(self) -> BackendStats:
        return self.sched.stats()

    def expected_output_tokens(self, request: GenerateRequest) -> int:
        return output_end(request, self.max_model_len)[0]

    async def reload_weights(self, version: int, weights_path: str) -> None:
        await self._sleep_virtual(self.weight_update_s)
        self.sched.cache.clear()

    async def set_role(self, role: str) -> None:
        await self._sleep_virtual(pm.role_switch_time_s(self.profile))
        self.sched.set_role(role)

    # -- engine loop ---------------------------------------------------------------------------------------------

    async def _engine_loop(self) -> None:
        while True:
            self._wake.clear()
            step = self.sched.plan(self.clock.monotonic_s(), self.coalesce_wall_s * self.speedup)
            if step is None:
                self._deadline_s = None  # idle: the next busy period starts from its own arrival
                await self._wake.wait()
                continue
            await self._pace(step.duration_s)
            for seq in self.sched.apply(step, self.clock.monotonic_s()):
                self._notify(seq)

    async def _pace(self, virtual_s: float) -> None:
        """Wait until the deadline moved on by `virtual_s` of modelled time, counted from the previous step's
        deadline while busy (so overhead is absorbed), never from further back than `MAX_LAG_WALL_S`."""
        now = self.clock.monotonic_s()
        start = now
        if self._deadline_s is not None:
            start = max(self._deadline_s, now - MAX_LAG_WALL_S * self.clock.time_scale)
        self._deadline_s = start + self._scaled_s(virtual_s)
        await self.clock.sleep_s(self._deadline_s - now)  # <= 0 when behind: still yields to the streams

    def _scaled_s(self, virtual_s: float) -> float:
        """Scaled seconds that `virtual_s` modelled seconds last (equal when speedup = time scale)."""
        return virtual_s * self.clock.time_scale / self.speedup

    async def _sleep_virtual(self, virtual_s: float) -> None:
        await self.clock.sleep_s(self._scaled_s(virtual_s))

    def _notify(self, seq: SimSeq) -> None:
        if seq.mode == "prefill":
            fut = self._futures.get(seq.request_id)
            if fut is not None and not fut.done() and seq.first is not None and seq.prefill_info is not None:
                fut.set_result(self._prefill_result(seq))
            return
        signal = self._signals.get(seq.request_id)
        if signal is not None:
            signal.set()
        if seq.done:
            done = self._done_events.get(seq.request_id)
            if done is not None:
                done.set()

    async def wait_output(self, request_id: str, max_wait_s: float) -> None:
        """The runner's pause between two chunks of a stream (wall seconds), cut short when the request ends: its
        last tokens leave at once instead of up to `max_wait_s` later, a delay the speed-up would multiply."""
        seq = self._streaming.get(request_id)
        if seq is None or seq.done:
            return
        done = self._done_events.setdefault(request_id, asyncio.Event())
        try:
            await asyncio.wait_for(done.wait(), max_wait_s)
        except TimeoutError:
            pass
        finally:
            self._done_events.pop(request_id, None)

    async def _stream(self, seq: SimSeq) -> AsyncIterator[GenChunk]:
        signal = self._signals[seq.request_id]
        self._streaming[seq.request_id] = seq
        try:
            while True:
                await signal.wait()
                signal.clear()
                if seq.aborted:
                    return
                ids, lps = seq.take()
                info, seq.prefill_info = seq.prefill_info, None
                finished = (
                    seq.done
                )  # read before yielding: the sequence may finish while the consumer holds it
                yield GenChunk(ids, lps, finished=finished, finish_reason=seq.finish_reason, prefill=info)
                if finished:
                    return
        finally:
            self._signals.pop(seq.request_id, None)
            self._streaming.pop(seq.request_id, None)
            if not seq.done:  # the consumer left early: free the sequence
                self.sched.remove(seq.request_id)

    # -- helpers -------------------------------------------------------------------------------------------------

    def _seq(self, request: GenerateRequest, mode: SeqMode, context: int, pos: int) -> SimSeq:
        if request.request_id in self._signals or request.request_id in self._futures:
            raise BackendError(f"request {request.request_id} is already running on this engine")
        end, reason = output_end(request, self.max_model_len)
        return SimSeq(
            request_id=request.request_id,
            traj_id=request.traj_id,
            mode=mode,
            context_tokens=context,
            pos=pos,
            end=end,
            end_reason=reason,
            tokens=SimTokens(request.request_id, self.vocab_size),
            want_logprobs=request.sampling.logprobs,
            cacheable_tokens=min(request.sim_cacheable_tokens, context),
        )

    def _prefill_result(self, seq: SimSeq) -> PrefillResult:
        assert seq.first is not None and seq.prefill_info is not None
        token, logprob = seq.first
        finished = seq.pos + 1 >= seq.end
        return PrefillResult(
            first_token_id=token,
            first_logprob=logprob if seq.want_logprobs else None,
            kv_transfer_params={
                "sim_engine": self.engine_id,
                "sim_expires_s": self.clock.now_s() + self._scaled_s(self.kv_ttl_s),
            },
            new_tokens=seq.prefill_info.new_tokens,
            cached_tokens=seq.prefill_info.cached_tokens,
            prefill_s=seq.prefill_info.prefill_s,
            finished=finished,
            finish_reason=seq.end_reason if finished else "",
        )

    def _check_kv(self, handoff: DecodeHandoff) -> None:
        params = handoff.kv_transfer_params
        expires = params.get("sim_expires_s") if isinstance(params, dict) else None
        now_s = self.clock.now_s()
        if isinstance(expires, int | float) and not isinstance(expires, bool) and now_s > expires:
            raise KvUnavailable(
                f"KV of {handoff.request.request_id} on {handoff.prefill_engine} expired "
                f"{now_s - expires:.1f} scaled s ago"
            )

    def _check_running(self) -> None:
        if self._task is None or self._task.done():
            raise BackendError("the simulated engine is not running (start() not called, or closed)")

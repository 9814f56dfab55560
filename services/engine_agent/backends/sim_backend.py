"""The simulated engine backend: `SimScheduler` run in wall-clock time, `speedup` virtual seconds per wall second.

The engine loop plans a step, sleeps its modelled duration / speedup, applies it and wakes the streams of the
sequences that produced tokens. Sleeps are paced against a deadline, so Python overhead inside a busy period is
absorbed by the next sleeps instead of slowing the modelled engine down (a backlog is never carried across an idle
period). KV transfer (decode side) is a sleep of `kv_transfer_time_s / speedup` outside the step loop, as a real
KV connector moves data while the engine keeps stepping.

KV handed to a decode engine is named by `kv_transfer_params = {"sim_engine": <engine>, "sim_expires_s": <Unix
time>}`: a prefill engine keeps a handed-off prompt's KV for `kv_ttl_s` virtual seconds (vLLM's NIXL connector
frees unclaimed blocks after a timeout, `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480 s by default); a decode that comes
later finds it gone (`KvUnavailable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from proto import DecodeHandoff, GenerateRequest
from services.engine_agent import perf_model as pm
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
    SeqMode,
    SimScheduler,
    SimSeq,
    context_tokens,
    output_end,
)
from services.engine_agent.backends.sim_tokens import QWEN3_VOCAB_SIZE, SimTokens
from services.engine_agent.perf_model import ModelProfile

DEFAULT_MAX_MODEL_LEN = 131_072  # Qwen3 with YaRN; the SWE trace's contexts reach ~76k tokens at p99
DEFAULT_KV_TTL_S = 480.0


class SimBackend:
    """`Backend` over the performance model (see the module docstring)."""

    name = "sim"

    def __init__(
        self,
        profile: ModelProfile,
        engine_id: str,
        *,
        role: str = "mixed",
        speedup: float = 10.0,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        vocab_size: int = QWEN3_VOCAB_SIZE,
        kv_ttl_s: float = DEFAULT_KV_TTL_S,
        weight_update_s: float | None = None,
    ) -> None:
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.profile = profile
        self.engine_id = engine_id
        self.speedup = speedup
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.kv_ttl_s = kv_ttl_s
        # The profile has no weight-update cost; an in-place reload is modelled like a role switch (flush + warm-up
        # with the new weights already on the hosts) unless given.
        self.weight_update_s = pm.role_switch_time_s(profile) if weight_update_s is None else weight_update_s
        self.sched = SimScheduler(profile, role, max_model_len)
        self._signals: dict[str, asyncio.Event] = {}
        self._futures: dict[str, asyncio.Future[PrefillResult]] = {}
        self._wake = asyncio.Event()
        self._deadline = 0.0
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
            await asyncio.sleep(pm.kv_transfer_time_s(self.profile, context_tokens(request)) / self.speedup)
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
        fut = self._futures.get(request_id)
        if fut is not None and not fut.done():
            fut.set_exception(RequestAborted(f"request {request_id} aborted"))

    def stats(self) -> BackendStats:
        return self.sched.stats()

    def expected_output_tokens(self, request: GenerateRequest) -> int:
        return output_end(request, self.max_model_len)[0]

    async def reload_weights(self, version: int, weights_path: str) -> None:
        await asyncio.sleep(self.weight_update_s / self.speedup)
        self.sched.cache.clear()

    async def set_role(self, role: str) -> None:
        await asyncio.sleep(pm.role_switch_time_s(self.profile) / self.speedup)
        self.sched.set_role(role)

    # -- engine loop ---------------------------------------------------------------------------------------------

    async def _engine_loop(self) -> None:
        while True:
            self._wake.clear()
            step = self.sched.plan(time.monotonic())
            if step is None:
                await self._wake.wait()
                continue
            await self._pace(step.duration_s / self.speedup)
            for seq in self.sched.apply(step, time.monotonic()):
                self._notify(seq)

    async def _pace(self, wall_s: float) -> None:
        now = time.monotonic()
        self._deadline = max(self._deadline, now) + wall_s
        await asyncio.sleep(max(0.0, self._deadline - now))

    def _notify(self, seq: SimSeq) -> None:
        if seq.mode == "prefill":
            fut = self._futures.get(seq.request_id)
            if fut is not None and not fut.done() and seq.first is not None and seq.prefill_info is not None:
                fut.set_result(self._prefill_result(seq))
            return
        signal = self._signals.get(seq.request_id)
        if signal is not None:
            signal.set()

    async def _stream(self, seq: SimSeq) -> AsyncIterator[GenChunk]:
        signal = self._signals[seq.request_id]
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
                "sim_expires_s": time.time() + self.kv_ttl_s / self.speedup,
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
        if isinstance(expires, int | float) and not isinstance(expires, bool) and time.time() > expires:
            raise KvUnavailable(
                f"KV of {handoff.request.request_id} on {handoff.prefill_engine} expired "
                f"{time.time() - expires:.1f} s ago"
            )

    def _check_running(self) -> None:
        if self._task is None or self._task.done():
            raise BackendError("the simulated engine is not running (start() not called, or closed)")

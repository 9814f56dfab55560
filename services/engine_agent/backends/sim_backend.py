"""The simulated engine backend: the engine core that ships (`engine_core.EngineCore`, driven as a `SoloEngine`),
paced on the scaled clock at `speedup` modelled seconds per wall second.

The rules — continuous batching, chunked prefill, decode jumps, KV reservation, prefix cache, the first output token
sampled by the step that completes a prompt — are the core's, the same object the discrete-event simulator runs;
this shell adds only what a live engine needs besides: token ids (`SimTokens`, a pure function of the request id
and position), streams and futures, KV expiry, and the clock.

Time. The engine's modelled time is the scaled clock times `speedup / time_scale` (equal when `speedup` is the time
scale, the default: the engine's modelled seconds then *are* the scaled seconds every service measures). Before
anything touches the core, it is advanced to that time (`SoloEngine.advance`: every step end and KV arrival due by
then, at its exact modelled time), so Python's overhead and late wake-ups never slow the modelled engine down and
never move a modelled time; a late event loop only delays when the tokens reach the consumer. The engine loop
sleeps until the core's next event; a stream reads the tokens out by now (the steps of a decode jump completed so
far, `EngineCore.steps_at`) whenever its consumer asks.

Weights and pauses. A pause (a trainer's, or a weight load's) freezes the engine's modelled time: nothing advances
until the last reason is lifted, then the engine goes on where it stopped. A weight load pauses, waits the
profile's update time (`weight_update_s`), switches `policy_version` and resumes: every token out before the switch
carries the old version, every later one the new (each sequence keeps its version marks; a stream splits a chunk
at a mark).

KV handed to a decode engine is named by `kv_transfer_params = {"sim_engine": <engine>, "sim_expires_s": <Unix
time, scaled seconds (Clock.now_s)>}`: a prefill engine keeps a handed-off prompt's KV for `kv_ttl_s` modelled
seconds (vLLM's NIXL connector frees unclaimed blocks after a timeout, `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480 s by
default); a decode that comes later finds it gone (`KvUnavailable`). The transfer itself is the core's
(`accept_handoff`: the modelled transfer time, then the request joins the batch at a step boundary).

Sampling. There are no logits: ids and logprobs are a pure function of request id and position (`SimTokens`), so
temperature, top-k/top-p, seed and the presence, frequency and repetition penalties are accepted and change nothing
(a sampler without logits has nothing for them to act on), and raw and processed logprobs are the same numbers.
What can be honoured is: `min_tokens` lengthens an output the workload would end sooner (up to max_tokens and the
model length), and `top_logprobs` returns k alternatives per token (`SimTokens.top`: deterministic, holding the
sampled token where it ranks within the k).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Literal

from proto import ROLES, DecodeHandoff, GenerateRequest, SamplingParams
from services.engine_agent.backend import (
    BackendError,
    BackendStats,
    EngineDead,
    GenChunk,
    KvUnavailable,
    PrefillInfo,
    PrefillResult,
    RequestAborted,
)
from services.engine_agent.backends.sim_tokens import QWEN3_VOCAB_SIZE, SimTokens
from services.engine_agent.engine_core import DEFAULT_MAX_MODEL_LEN, WHOLE_CONTEXT, CoreSeq
from services.engine_agent.solo_engine import SoloEngine
from services.runtime import perf_model as pm
from services.runtime.clock import Clock, scale_from_env
from services.runtime.logging import get_logger
from services.runtime.model_profiles import weight_update_time_s
from services.runtime.perf_model import ModelProfile

SeqMode = Literal["generate", "prefill", "decode"]

DEFAULT_KV_TTL_S = 480.0
DEFAULT_SPEEDUP = (
    10.0  # virtual seconds per wall second when neither `speedup` nor $PRORSA_TIME_SCALE is given
)
# Longest a stream with no token out waits before looking again (wall): the next token can come no later than the
# core's next event, which it waits for, but a decode jump's steps end between events.
STREAM_POLL_WALL_S = 0.005


def context_tokens(request: GenerateRequest) -> int:
    """Tokens in the request's context: the prompt plus output already streamed before a migration."""
    return request.prompt_len + len(request.resume_token_ids)


def output_end(request: GenerateRequest, max_model_len: int) -> tuple[int, str]:
    """(whole-turn output length, finish reason): the workload's `sim_output_tokens` (else max_tokens), at least
    `min_tokens` (no stop before it), capped by max_tokens and the model length. "length" when a cap ends it, else
    "stop" (as if the model sampled EOS)."""
    max_tokens = request.sampling.max_tokens
    cap = min(max_tokens, max(0, max_model_len - request.prompt_len))
    want = request.sim_output_tokens if request.sim_output_tokens > 0 else max_tokens
    end = min(max(want, request.sampling.min_tokens), cap)
    return end, "length" if end == cap else "stop"


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


class LiveSeq(CoreSeq):
    """A request inside the live simulated engine: the core's sequence plus its stream's positions and tokens.

    Output positions `first_pos` .. `end - 1` are this call's: the prefill samples `first_pos` (for a `decode`, the
    prefill engine did), each decode step one more."""

    __slots__ = (
        "request_id",
        "mode",
        "first_pos",
        "end",
        "end_reason",
        "tokens",
        "want_logprobs",
        "top_k",
        "next_pos",
    )
    __slots__ += ("prefilled", "prefill_info", "done", "aborted", "version_marks")

    def __init__(
        self,
        rid: int,
        request: GenerateRequest,
        mode: SeqMode,
        max_model_len: int,
        vocab_size: int,
        version: int = 0,
    ) -> None:
        first_pos = len(request.resume_token_ids)
        end, reason = output_end(request, max_model_len)
        cacheable = request.sim_cacheable_tokens
        super().__init__(
            rid,
            request.traj_id,
            context_tokens(request),
            max(end - first_pos, 0),
            cacheable_tokens=cacheable if cacheable > 0 else WHOLE_CONTEXT,
            remote=mode == "prefill",
        )
        self.request_id = request.request_id
        self.mode: SeqMode = mode
        self.first_pos = first_pos
        self.end = end
        self.end_reason = reason
        self.tokens = SimTokens(request.request_id, vocab_size)
        self.want_logprobs = request.sampling.logprobs
        self.top_k = request.sampling.top_logprobs  # alternatives per token (0: none)
        self.next_pos = first_pos + 1 if mode == "decode" else first_pos  # the next position to stream
        self.prefilled = mode == "decode"  # its first token is out
        self.prefill_info: PrefillInfo | None = None  # for the stream's first chunk (generate)
        self.done = False  # its last token is out
        self.aborted = False
        # (output position, weights version): the positions from each mark on were sampled by that version.
        self.version_marks: list[tuple[int, int]] = [(first_pos, version)]

    def version_at(self, pos: int) -> int:
        """The weights version that samples output position `pos` (the last mark at or before it)."""
        version = self.version_marks[0][1]
        for at, v in self.version_marks:
            if at <= pos:
                version = v
        return version


class SimBackend:
    """`Backend` over the engine core (see the module docstring)."""

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
        clock: Clock | None = None,
        restart_roles: tuple[str, ...] = (),
    ) -> None:
        """`speedup`: virtual seconds per wall second (None: see `resolve_speedup`). `clock`: the scaled clock
        (None: $PRORSA_TIME_SCALE's, read now; unset, it sets no speed-up). `restart_roles`: roles modelled as
        another engine layout, a switch to which restarts the engine (`set_role`; a live vLLM engine's come from
        `--role-engine-arg`). Raises ValueError on bad values."""
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
        unknown = [r for r in restart_roles if r not in ROLES]
        if unknown:
            raise ValueError(f"restart_roles: unknown role(s) {unknown}; expected some of {ROLES}")
        self.restart_roles = tuple(restart_roles)
        self.profile = profile
        self.engine_id = engine_id
        self.clock = clock
        self.speedup = speedup
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.kv_ttl_s = kv_ttl_s
        # Modelled seconds a weight load freezes the engine (the profile's published figure, `WEIGHT_UPDATE_S`).
        self.weight_update_s = weight_update_time_s(profile) if weight_update_s is None else weight_update_s
        self.policy_version = 0  # the weights version serving now
        self._pause_reasons: set[str] = set()
        self._paused_at: float | None = None  # scaled monotonic seconds the engine froze at (None: running)
        self._paused_total = 0.0  # scaled seconds spent frozen, taken out of the modelled time
        self.core = SoloEngine(profile, role)
        self.core.now = self._modelled_now()
        self._next_rid = 0
        self._seqs: dict[str, LiveSeq] = {}  # request id → sequence, while it runs here
        self._signals: dict[str, asyncio.Event] = {}
        self._done_events: dict[str, asyncio.Event] = {}  # set when the sequence ends (see wait_output)
        self._futures: dict[str, asyncio.Future[PrefillResult]] = {}
        self._wake = asyncio.Event()
        self._planned_s: float | None = None  # the core event the engine loop waits for (None: none)
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._engine_loop(), name=f"sim-engine-{self.engine_id}")

    async def check_alive(self) -> None:
        """The engine loop is this engine: once it has ended (crashed, or stopped under a running agent), nothing
        moves any more. Raises EngineDead then."""
        task = self._task
        if task is not None and task.done():
            error = None if task.cancelled() else task.exception()
            raise EngineDead(f"simulated engine {self.engine_id}: engine loop ended ({error!r})")

    def sampling_problem(self, sampling: SamplingParams) -> str:
        # Everything a SamplingParams can hold is taken (see "Sampling" in the module doc): nothing refused.
        return ""

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for rid in list(self._seqs):
            await self.abort(rid)

    # -- the Backend protocol ------------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenChunk]:
        seq = self._seq(request, "generate")
        if seq.first_pos >= seq.end:
            yield GenChunk(
                [], None, finished=True, finish_reason=seq.end_reason, prefill=PrefillInfo(0, 0, 0.0)
            )
            return
        self._check_running()
        self._admit(seq)
        self._sync()
        self.core.submit(seq)
        self._settle()
        async for chunk in self._stream(seq):
            yield chunk

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        seq = self._seq(request, "prefill")
        if seq.first_pos >= seq.end:
            raise BackendError(f"request {request.request_id}: nothing left to generate")
        self._check_running()
        fut: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        self._futures[seq.request_id] = fut
        self._admit(seq)
        self._sync()
        self.core.submit(seq)
        self._settle()
        try:
            return await fut
        finally:
            self._futures.pop(seq.request_id, None)
            if self._seqs.get(seq.request_id) is seq:
                self._drop(seq)

    async def decode(self, handoff: DecodeHandoff) -> AsyncIterator[GenChunk]:
        seq = self._seq(handoff.request, "decode")
        if seq.next_pos >= seq.end:  # the first token, sampled by the prefill engine, was the last
            yield GenChunk([], None, finished=True, finish_reason=seq.end_reason)
            return
        self._check_kv(handoff)
        self._check_running()
        self._admit(seq)
        self._sync()
        self.core.receive(seq)
        self._settle()
        async for chunk in self._stream(seq):
            yield chunk

    async def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None:
            seq.aborted = True
            self._drop(seq)
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
        self._sync()
        core = self.core
        return BackendStats(
            running=len(core.seqs) + len(core.active),
            waiting=len(core.queue) + len(core.arrivals) + core.incoming,
            kv_used_tokens=core.kv_reserved,
            kv_capacity_tokens=self.profile.kv_capacity_tokens,
            max_batch=self.profile.max_batch,
            prefix_cache_tokens=core.cache.used_tokens,
            restart_roles=self.restart_roles,
        )

    def expected_output_tokens(self, request: GenerateRequest) -> int:
        return output_end(request, self.max_model_len)[0]

    async def reload_weights(self, version: int, weights_path: str) -> None:
        await self._swap_weights(version)

    async def init_weight_transfer(self, init_info: dict) -> None:
        """Nothing to join: a simulated engine receives tensors as it reloads checkpoints (priced the same)."""

    async def receive_weights(self, version: int, transfer: dict) -> None:
        await self._swap_weights(version)  # priced as a reload: the profile has one figure for both

    async def _swap_weights(self, version: int) -> None:
        """Between two steps: freeze, pay the update time, mark every sequence, switch, go on."""
        await self.pause_generation("weights")
        try:
            await self._sleep_modelled(self.weight_update_s)
            for seq in self._seqs.values():
                seq.version_marks.append((self._out_pos(seq), version))
            self.policy_version = version
            self.core.cache.clear()  # no later turn reuses KV computed with the old weights
        finally:
            await self.resume_generation("weights")

    async def pause_generation(self, reason: str) -> None:
        if not self._pause_reasons:
            self._sync()  # everything due by now happens before the freeze
            self._paused_at = self.clock.monotonic_s()
        self._pause_reasons.add(reason)

    async def resume_generation(self, reason: str) -> None:
        if reason not in self._pause_reasons:
            return
        self._pause_reasons.discard(reason)
        if not self._pause_reasons and self._paused_at is not None:
            self._paused_total += self.clock.monotonic_s() - self._paused_at
            self._paused_at = None
            self._wake.set()

    @property
    def paused(self) -> bool:
        return bool(self._pause_reasons)

    async def set_role(self, role: str) -> None:
        """In place, the profile's `role_switch_s` (what the engine holds runs on meanwhile, then the core serves
        the new role with it); a restart into another layout (`restart_roles`, called drained), its
        `engine_start_s` and an empty prefix cache."""
        restart = role in self.restart_roles
        await self._sleep_modelled(
            pm.engine_start_time_s(self.profile) if restart else pm.role_switch_time_s(self.profile)
        )
        self._sync()
        self.core.set_role(role)
        if restart:
            self.core.cache.clear()
        self._wake.set()

    # -- driving the core ----------------------------------------------------------------------------------------

    def _modelled_now(self) -> float:
        """The engine's modelled time now: the scaled clock, less the time spent paused, times speedup / time
        scale (frozen while paused)."""
        now = self.clock.monotonic_s() if self._paused_at is None else self._paused_at
        return (now - self._paused_total) * self.speedup / self.clock.time_scale

    def _sync(self) -> None:
        """Run the core up to now, and act on what it did."""
        self.core.advance(self._modelled_now())
        self._settle()

    def _settle(self) -> None:
        """Act on the core's effects: wake streams, answer prefill futures."""
        core = self.core
        for seq, t in core.prefilled:
            self._prefilled(seq, t)  # type: ignore[arg-type]
        for seq, _ in core.handed_off:
            self._answer_prefill(seq)  # type: ignore[arg-type]
        for seq, _ in core.finished:
            self._finished(seq)  # type: ignore[arg-type]
        core.prefilled.clear()
        core.handed_off.clear()
        core.finished.clear()
        nxt = core.next_event_s()
        if nxt is not None and (self._planned_s is None or nxt < self._planned_s):
            self._wake.set()  # the engine loop waits for a later event, or for none: it must look again

    def _prefilled(self, seq: LiveSeq, t: float) -> None:
        seq.prefilled = True
        seq.prefill_info = PrefillInfo(
            new_tokens=seq.to_compute_tokens,
            cached_tokens=seq.hit_tokens,
            prefill_s=t - seq.started_s,
        )
        self._notify(seq)

    def _finished(self, seq: LiveSeq) -> None:
        seq.done = True
        if self._seqs.get(seq.request_id) is seq:
            del self._seqs[seq.request_id]
        if seq.mode == "prefill":
            self._answer_prefill(seq)
            return
        self._notify(seq)
        done = self._done_events.get(seq.request_id)
        if done is not None:
            done.set()

    def _answer_prefill(self, seq: LiveSeq) -> None:
        """A prefill for a remote decode is done (its KV handed off, or its first token ends the turn)."""
        if self._seqs.get(seq.request_id) is seq:
            del self._seqs[seq.request_id]
        fut = self._futures.get(seq.request_id)
        if fut is None or fut.done() or seq.prefill_info is None:
            return
        info = seq.prefill_info
        token, logprob = seq.tokens.at(seq.first_pos)
        finished = seq.first_pos + 1 >= seq.end
        fut.set_result(
            PrefillResult(
                first_token_id=token,
                first_logprob=logprob if seq.want_logprobs else None,
                first_top_logprobs=seq.tokens.top(seq.first_pos, seq.top_k) if seq.top_k else None,
                kv_transfer_params={
                    "sim_engine": self.engine_id,
                    "sim_expires_s": self.clock.now_s() + self._scaled_s(self.kv_ttl_s),
                },
                new_tokens=info.new_tokens,
                cached_tokens=info.cached_tokens,
                prefill_s=info.prefill_s,
                finished=finished,
                finish_reason=seq.end_reason if finished else "",
                policy_version=seq.version_at(seq.first_pos),
            )
        )

    def _out_pos(self, seq: LiveSeq) -> int:
        """The output position before which `seq`'s tokens are out by the core's time."""
        if seq.done:
            return seq.end
        core = self.core
        if core.seqs.get(seq.rid) is seq:
            return seq.first_pos + 1 + min(core.steps_at(core.now), seq.target_step) - seq.start_step
        return seq.first_pos + 1 if seq.prefilled else seq.first_pos

    async def _engine_loop(self) -> None:
        """Wake the core at its next event (step end, KV arrival), or when new work may have changed it."""
        while True:
            if self._pause_reasons:  # frozen: nothing is due until resumed (resume_generation wakes us)
                self._wake.clear()
                await self._wake.wait()
                continue
            self._sync()
            self._wake.clear()
            t = self._planned_s = self.core.next_event_s()
            if t is None:
                await self._wake.wait()
                continue
            await _wait_event(self._wake, self.clock.wall_s(self._scaled_s(t - self.core.now)))

    def _scaled_s(self, modelled_s: float) -> float:
        """Scaled seconds that `modelled_s` modelled seconds last (equal when speedup = time scale)."""
        return modelled_s * self.clock.time_scale / self.speedup

    async def _sleep_modelled(self, modelled_s: float) -> None:
        await self.clock.sleep_s(self._scaled_s(modelled_s))

    def _notify(self, seq: LiveSeq) -> None:
        signal = self._signals.get(seq.request_id)
        if signal is not None:
            signal.set()

    async def wait_output(self, request_id: str, max_wait_s: float) -> None:
        """The runner's pause between two chunks of a stream (wall seconds), cut short when the request ends: its
        last tokens leave at once instead of up to `max_wait_s` later, a delay the speed-up would multiply."""
        self._sync()
        seq = self._seqs.get(request_id)
        if seq is None or seq.done:
            return
        done = self._done_events.setdefault(request_id, asyncio.Event())
        try:
            await _wait_event(done, max_wait_s)
        finally:
            self._done_events.pop(request_id, None)

    async def _stream(self, seq: LiveSeq) -> AsyncIterator[GenChunk]:
        signal = self._signals[seq.request_id]
        try:
            while True:
                self._sync()
                if seq.aborted:
                    return
                out = self._out_pos(seq)
                info, seq.prefill_info = seq.prefill_info, None
                if out > seq.next_pos or info is not None or seq.done:
                    start, seq.next_pos = seq.next_pos, out
                    # Read before yielding: the sequence may finish while the consumer holds a chunk.
                    finished = seq.done
                    runs = _version_runs(seq, start, out)
                    for i, (lo, hi, version) in enumerate(runs):
                        pairs = [seq.tokens.at(p) for p in range(lo, hi)]
                        last = i == len(runs) - 1
                        yield GenChunk(
                            [t for t, _ in pairs],
                            [lp for _, lp in pairs] if seq.want_logprobs else None,
                            finished=finished and last,
                            finish_reason=seq.end_reason if finished and last else "",
                            prefill=info if i == 0 else None,
                            top_logprobs=[seq.tokens.top(p, seq.top_k) for p in range(lo, hi)]
                            if seq.top_k
                            else None,
                            policy_version=version,
                        )
                    if finished:
                        return
                    continue
                signal.clear()
                nxt = self.core.next_event_s()
                wait = STREAM_POLL_WALL_S
                if nxt is not None:
                    wait = min(wait, self.clock.wall_s(self._scaled_s(nxt - self.core.now)))
                await _wait_event(signal, wait)
        finally:
            self._signals.pop(seq.request_id, None)
            if self._seqs.get(seq.request_id) is seq:  # the consumer left early: free the sequence
                self._drop(seq)

    # -- helpers -------------------------------------------------------------------------------------------------

    def _seq(self, request: GenerateRequest, mode: SeqMode) -> LiveSeq:
        if request.request_id in self._seqs:
            raise BackendError(f"request {request.request_id} is already running on this engine")
        self._next_rid += 1
        return LiveSeq(
            self._next_rid, request, mode, self.max_model_len, self.vocab_size, self.policy_version
        )

    def _admit(self, seq: LiveSeq) -> None:
        self._seqs[seq.request_id] = seq
        if seq.mode != "prefill":
            self._signals[seq.request_id] = asyncio.Event()

    def _drop(self, seq: LiveSeq) -> None:
        """Take `seq` out: the core frees it at its next step boundary."""
        del self._seqs[seq.request_id]
        self._sync()
        self.core.drop(seq)
        self._settle()

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


def _version_runs(seq: LiveSeq, start: int, end: int) -> list[tuple[int, int, int]]:
    """Output positions [start, end) cut where the weights version changes: (lo, hi, version) runs, at least one
    (an empty one for a chunk without tokens)."""
    runs: list[tuple[int, int, int]] = []
    for pos in range(start, end):
        version = seq.version_at(pos)
        if runs and runs[-1][2] == version:
            runs[-1] = (runs[-1][0], pos + 1, version)
        else:
            runs.append((pos, pos + 1, version))
    return runs or [(start, start, seq.version_at(start))]


async def _wait_event(event: asyncio.Event, timeout_s: float) -> None:
    """Wait until `event` is set or `timeout_s` wall seconds pass (<= 0: just yield). Not `asyncio.wait_for`:
    before Python 3.12 it swallows a cancellation that arrives as the event is set (cpython#86296), which left a
    closed backend's engine loop running."""
    if timeout_s <= 0:
        await asyncio.sleep(0)
        return
    timer = asyncio.get_running_loop().call_later(timeout_s, event.set)
    try:
        await event.wait()
    finally:
        timer.cancel()

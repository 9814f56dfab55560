"""The asyncio client a trainer imports to roll out trajectories on a Prorsa cluster.

    client = await RolloutClient.connect("nats://127.0.0.1:4222")
    traj = await client.start_trajectory(task="coding", policy_version=3)
    out = await traj.generate(prompt_ids, SamplingParams(max_tokens=512))
    await traj.tool_started("bash"); ...; await traj.tool_finished("bash", observation_tokens=180)
    await traj.finish(reward=1.0)

It publishes the lifecycle events the tracker needs (with a per-client sequence number), sends each turn to the
engine that holds the trajectory's prefix when that engine can take it (else to the shared prefill queue), and
assembles the token stream exactly once (`stream.StreamAssembler`). Timestamps on the bus use the shared scaled
clock (`client.clock`, a `services.runtime.clock.Clock`); retry and staleness timers are wall-clock
(`time.monotonic`), as they guard against real outages.
A request that shows no progress for `retry_after_s` is republished with the same request_id and attempt+1;
whichever copy completes first is the result and the other's chunks are dropped, so a retry never duplicates a
result.

Faults it rides out:
- A nats-server restart: publishes wait for the server (`publish_wait_s`), and after a reconnect the chunks missed
  meanwhile are read back from the REPLIES stream (`recovery.py`); a stream left incomplete is retried after
  `recover_after_s` instead of `retry_after_s`.
- A saturated cluster: the work queue is bounded (`services/runtime/bus.py`), so a publish into a full queue is
  refused by the server. The client backs off (exponential, jittered, counted in `refused` and `saturated_s`) and
  tries again: nothing is dropped, and the turn waits at the client instead of lengthening the queue. With
  `admission_timeout_s` set, a turn refused for that long raises `ClusterSaturated` instead.
- Reused ids: JetStream drops a publish whose message id it saw in the last two minutes, so the message id is
  this client's run nonce and submission number (`<run_id>.<n>#<attempt>`), never the request id alone: a second
  run with the same trajectory ids is not silently dropped. A request id already in flight on this client is
  refused with a ValueError (its token streams could not be told apart).
The RL control plane (`control.py`): `update_weights` makes a policy version current (durably: the policy KV
bucket) and returns once every live engine serves it, else raises `WeightUpdateError` naming the engines that do
not; `pause`/`resume` stop and restart all generation; `abort_older_than` aborts every turn of an older version
and returns this client's partial outputs. Every result carries per-token versions (`GenerateResult.token_versions`),
and a turn may name the oldest version it accepts (`min_policy_version`).
The lean wire (`lean_wire`, on by default; `proto/context_log.py`): a turn whose prompt extends the trajectory's
previous prompt sends only the ids after it, with a reference (`prefix_turn`, `prefix_len`) that the engine holding
the previous prompt extends in memory; before publishing, the client writes the turn's segment to the context log,
a stream that outlives any engine, so whichever engine takes the turn (a redelivery, a migration, a decode
handoff) can rebuild it. Segments longer than `inline_max_tokens` are not repeated inline. A trajectory's log is
purged when it finishes. A request still larger than the server's max_payload raises `PayloadTooLarge` before
anything is published (the tracker never sees a turn that cannot run).
Every subject it uses is documented in proto/README.md, so a trainer in another language can do the same.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

import proto
from prorsa.client.control import PolicyControl
from prorsa.client.directory import EngineDirectory
from prorsa.client.lean_wire import ContextLogWriter, LeanPrompts, TurnWire
from prorsa.client.recovery import replay, watch_reconnects
from prorsa.client.stream import GenerateResult, StreamAssembler
from prorsa.client.weights import WeightsAck
from proto import (
    AbortRequest,
    EngineStats,
    GenerateRequest,
    LifecycleEvent,
    ProtoError,
    SamplingParams,
    Subjects,
    TokenChunk,
    ToolCallFinished,
    ToolCallStarted,
    TrajectoryFinished,
    TrajectoryStarted,
    TurnSubmitted,
)
from services.runtime.affinity import worth_prompts
from services.runtime.bus import (
    TRANSIENT_PUBLISH_ERRORS,
    connect,
    ensure_streams,
    is_queue_full,
    js_publish_patiently,
)
from services.runtime.clock import Clock
from services.runtime.credentials import BusCredentials
from services.runtime.logging import get_logger

if TYPE_CHECKING:
    from prorsa.client.workload_hint import WorkloadHint

log = get_logger("rollout_client", "sdk")


class GenerateError(RuntimeError):
    """The engine rejected the request (e.g. prompt longer than the model length); retrying will not help."""


class PayloadTooLarge(GenerateError):
    """A turn's request exceeds the server's max_payload; publishing it would fail, so it is never sent."""


# Segment ids sent inline up to this many (~100 kB of JSON); beyond, the engine reads them from the context log,
# which carries them as 4-byte binary ids in parts under max_payload.
DEFAULT_INLINE_MAX_TOKENS = 16_384


class ClusterSaturated(RuntimeError):
    """The work queue refused a turn for longer than the client's `admission_timeout_s`: the cluster is saturated."""


@dataclass
class _Pending:
    assembler: StreamAssembler
    done: asyncio.Future[GenerateResult]
    last_progress_mono: float
    on_tokens: Callable[[list[int]], None] | None = None
    on_chunk: Callable[[TokenChunk], None] | None = None  # each new chunk whole (ids and their logprobs)
    # When this request was last retried early (`_broken`), as the reconnect time it followed (-1: after a hole
    # without reconnect): one early retry per outage, later ones wait retry_after_s.
    early_retried_after: float | None = None
    retry_was_early: bool = False  # why `_wait` last gave up: an outage's hole (True) or a stall


class RolloutClient:
    def __init__(
        self,
        nc: NATS,
        namespace: str = "prorsa",
        client_id: str | None = None,
        retry_after_s: float = 120.0,
        max_attempts: int = 3,
        admission_timeout_s: float | None = None,
        publish_wait_s: float = 120.0,
        recover_after_s: float = 3.0,
        clock: Clock | None = None,
        lean_wire: bool = True,
        inline_max_tokens: int = DEFAULT_INLINE_MAX_TOKENS,
    ) -> None:
        """`clock`: the scaled clock stamps are taken on (None: $PRORSA_TIME_SCALE's, read now). `lean_wire`: send
        each turn's new ids and log its segment (False: the whole context inline every turn, as schema 1 did)."""
        self.nc = nc
        self.clock = clock if clock is not None else Clock.from_env()
        self.js = nc.jetstream()
        self.subjects = Subjects(namespace)
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:8]}"
        self.run_id = uuid.uuid4().hex[:12]  # this client instance: part of every work message id
        self.retry_after_s = retry_after_s
        self.max_attempts = max_attempts
        self.admission_timeout_s = admission_timeout_s  # None: wait for admission as long as it takes
        self.publish_wait_s = publish_wait_s  # wall seconds a publish waits for an unreachable server
        self.recover_after_s = recover_after_s
        self.directory = EngineDirectory()
        self._seq = itertools.count(1)
        self._submissions = itertools.count()
        self._pending: dict[str, _Pending] = {}
        self._reply_prefix = self.subjects.reply(self.client_id)
        self._subs: list = []
        self._tasks: list[asyncio.Task[None]] = []
        self._reconnected_mono: float | None = None
        self.dropped_chunks = 0
        self.bad_messages = 0
        self.refused = 0  # publishes refused by a full work queue
        self.saturated_s = 0.0  # wall seconds turns spent backing off from a full queue
        self.replayed_chunks = 0  # chunks read back from the REPLIES stream after reconnects
        self.early_retries = 0  # streams retried after an outage left them incomplete
        self.prefix_breaks = 0  # turns whose prompt did not extend their trajectory's last prompt + output
        self.lean_wire = lean_wire
        self.inline_max_tokens = inline_max_tokens
        self.context_log = ContextLogWriter(self.js, self.subjects, self.run_id, publish_wait_s)
        self.request_bytes = 0  # bytes of work requests published (first attempts)
        self.control = PolicyControl(self)

    @classmethod
    async def connect(
        cls, url: str, credentials: BusCredentials | None = None, **kwargs: object
    ) -> RolloutClient:
        """Connect as `credentials` (default: the PRORSA_NATS_* environment, e.g. a `trainer.env` written by
        `prorsa up`), reconnecting forever; `kwargs` go to the constructor."""
        log = get_logger("prorsa_client", "")

        async def on_error(exc: Exception) -> None:  # e.g. a permission violation: say so, quietly otherwise
            log.warning("nats_error", error=repr(exc))

        nc = await connect(url, "prorsa-client", credentials=credentials, error_cb=on_error)
        client = cls(nc, **kwargs)  # type: ignore[arg-type]
        await client.start()
        return client

    async def start(self) -> None:
        # The client may come up before any service: make sure the streams it publishes into exist.
        await ensure_streams(self.js, self.subjects)
        self._subs.append(await self.nc.subscribe(f"{self._reply_prefix}.>", cb=self._on_chunk))
        self._subs.append(await self.nc.subscribe(self.subjects.all_engine_stats, cb=self._on_stats))
        await self.control.start()
        self._tasks.append(asyncio.create_task(watch_reconnects(self.nc, self._on_reconnect)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for sub in self._subs:
            await sub.unsubscribe()
        await self.nc.drain()

    async def _on_reconnect(self, since_s: float) -> None:
        """Read back the chunks missed while disconnected (see recovery.py)."""
        self._reconnected_mono = time.monotonic()
        try:
            n = await replay(self.nc, self.subjects, self._reply_prefix, since_s, self._on_chunk_data)
        except (
            *TRANSIENT_PUBLISH_ERRORS,
            nats.errors.Error,
        ) as exc:  # gone again: the next reconnect replays
            log.warning("replay_failed", client=self.client_id, error=repr(exc))
            return
        self.replayed_chunks += n
        log.info("replayed_after_reconnect", client=self.client_id, chunks=n, pending=len(self._pending))

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def emit(self, make: Callable[..., LifecycleEvent], **fields: object) -> None:
        """Publish one lifecycle event into the EVENTS stream (JetStream-acked, so none is lost)."""
        msg = make(ts_s=self.clock.now_s(), source=self.client_id, seq=next(self._seq), **fields)
        headers = {"Nats-Msg-Id": f"{self.run_id}:{msg.seq}"}
        await js_publish_patiently(
            self.js, self.subjects.lifecycle, proto.encode(msg), headers, self.publish_wait_s
        )

    async def start_trajectory(
        self,
        traj_id: str | None = None,
        task: str = "",
        policy_version: int = 0,
        group: str = "",
        prompt_tokens: int = 0,
    ) -> Trajectory:
        traj = Trajectory(self, traj_id or f"t-{uuid.uuid4().hex[:12]}", task, policy_version)
        await self.emit(
            TrajectoryStarted,
            traj_id=traj.traj_id,
            task=task,
            policy_version=policy_version,
            group=group,
            prompt_tokens=prompt_tokens,
        )
        return traj

    async def close_trajectory(
        self, traj_id: str, reward: float | None = None, status: str = "aborted"
    ) -> None:
        """Finish a trajectory this client does not hold (another client started it: a gateway before its restart):
        its `TrajectoryFinished` (the tracker counts its turns) and the purge of its context log."""
        await self.emit(TrajectoryFinished, traj_id=traj_id, status=status, reward=reward, turns=0)
        await self.context_log.purge(traj_id)

    # --- the lean wire ---------------------------------------------------------------------------------------
    def check_payload(self, request: GenerateRequest) -> int:
        """The request's size in bytes. Raises PayloadTooLarge when it exceeds the server's max_payload."""
        size = len(proto.encode(request))
        limit = self.nc.max_payload
        if size > limit:
            raise PayloadTooLarge(
                f"turn {request.request_id}: the request is {size} bytes ({len(request.prompt_token_ids)} prompt ids "
                f"inline), over the server's max_payload of {limit} bytes; send it with the lean wire "
                "(RolloutClient(lean_wire=True), the default) or raise the server's max_payload (PRORSA_MAX_PAYLOAD "
                "for an embedded server)"
            )
        return size

    # --- generation -----------------------------------------------------------------------------------------
    async def submit(
        self,
        request: GenerateRequest,
        on_tokens: Callable[[list[int]], None] | None = None,
        timeout_s: float | None = None,
        on_chunk: Callable[[TokenChunk], None] | None = None,
        new_tokens: int = 0,
    ) -> GenerateResult:
        """Send a turn and wait for its whole output; retries a request that makes no progress. `new_tokens`: what
        the prompt appends to the trajectory's last prompt + output (0 = unknown), which prices a move away from
        the engine holding its prefix (`EngineDirectory.accepts_state`).

        Raises GenerateError (the engine refused it; PayloadTooLarge: too large to publish), TimeoutError (no result
        in time), ClusterSaturated (refused by a full queue for `admission_timeout_s`), ValueError (this request id
        is already in flight here)."""
        self.request_bytes += self.check_payload(request)
        if request.request_id in self._pending:
            raise ValueError(
                f"request {request.request_id} is already in flight on client {self.client_id}: request ids must be "
                "unique among concurrent turns (a trajectory id used twice at once?)"
            )
        submission = next(self._submissions)
        pending = _Pending(
            StreamAssembler(request.request_id),
            asyncio.get_running_loop().create_future(),
            time.monotonic(),
            on_tokens,
            on_chunk,
        )
        self._pending[request.request_id] = pending
        deadline = time.monotonic() + timeout_s if timeout_s else None
        try:
            stalls = 0  # retries after retry_after_s without progress; outage retries do not count
            for attempt in itertools.count():
                req = request if attempt == 0 else _with_attempt(request, attempt)
                worth = worth_prompts(request.prompt_len, new_tokens)
                await self._publish_request(req, f"{self.run_id}.{submission}#{attempt}", deadline, worth)
                pending.last_progress_mono = time.monotonic()
                result = await self._wait(pending, deadline)
                if result is not None:
                    if result.error:
                        raise GenerateError(result.error)
                    return result
                stalls += int(not pending.retry_was_early)
                if stalls >= self.max_attempts:
                    break
            raise TimeoutError(
                f"request {request.request_id} made no progress after {self.max_attempts} attempts"
            )
        finally:
            self._pending.pop(request.request_id, None)

    async def _wait(self, pending: _Pending, deadline: float | None) -> GenerateResult | None:
        """The result, or None when the request stalled (then the caller retries): no progress for retry_after_s,
        or an incomplete stream that an outage left without progress for recover_after_s (`_broken`)."""
        while True:
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise TimeoutError(f"request {pending.assembler.request_id} timed out")
            wait = self.retry_after_s - (now - pending.last_progress_mono)
            if wait <= 0:
                pending.retry_was_early = False
                return None
            outage = self._reconnected_mono if self._reconnected_mono is not None else -1.0
            if pending.early_retried_after != outage and self._broken(pending, now):
                pending.early_retried_after = outage
                pending.retry_was_early = True
                self.early_retries += 1
                log.info("stream_retried_after_outage", request_id=pending.assembler.request_id)
                return None
            try:
                return await asyncio.wait_for(asyncio.shield(pending.done), timeout=min(wait, 0.5))
            except TimeoutError:
                continue

    def _broken(self, pending: _Pending, now: float) -> bool:
        """A stream with a hole no engine will fill: its final chunk came but one before it never will, or it was
        streaming when the connection dropped and nothing came for recover_after_s after the reconnect (replay
        included). Only then is a retry sooner than retry_after_s worth recomputing the turn."""
        a = pending.assembler
        if not a.chunks or now - pending.last_progress_mono < self.recover_after_s:
            return False
        if a.final_index is not None:
            return True
        back = self._reconnected_mono
        return back is not None and pending.last_progress_mono < back and now - back >= self.recover_after_s

    async def _publish_request(
        self, req: GenerateRequest, msg_id: str, deadline: float | None, worth_prompts: float = 0.0
    ) -> None:
        """Publish a turn into the work queue; a full queue is backed off from (see the module doc)."""
        started = time.monotonic()
        delay = 0.05
        while True:
            target = (
                self.directory.affinity_target(req.affinity_engine, time.monotonic(), worth_prompts)
                if req.affinity_engine
                else None
            )
            subject = self.subjects.prefill_work_for(target) if target else self.subjects.prefill_work_any
            try:
                await self.js.publish(subject, proto.encode(req), headers={"Nats-Msg-Id": msg_id})
                return
            except TRANSIENT_PUBLISH_ERRORS as exc:
                now = time.monotonic()
                if is_queue_full(exc):
                    self.refused += 1
                    if self.admission_timeout_s is not None and now - started > self.admission_timeout_s:
                        raise ClusterSaturated(
                            f"the cluster is saturated: {subject} stayed full for {now - started:.1f} s "
                            f"(request {req.request_id})"
                        ) from exc
                elif now - started > self.publish_wait_s:
                    raise
                if deadline is not None and now > deadline:
                    raise TimeoutError(f"request {req.request_id} timed out waiting to be queued") from exc
            pause = delay * (0.5 + random.random())  # jittered: refused clients must not come back in step
            await asyncio.sleep(pause)
            if self.refused:
                self.saturated_s += pause
            delay = min(2.0, delay * 2)

    async def _on_chunk(self, msg: Msg) -> None:
        await self._on_chunk_data(msg.subject, msg.data)

    async def _on_chunk_data(self, subject: str, data: bytes) -> None:
        try:
            chunk = proto.decode_as(data, TokenChunk, subject)
        except ProtoError:
            self.bad_messages += 1
            return
        pending = self._pending.get(chunk.request_id)
        if pending is None:
            self.dropped_chunks += 1  # a late chunk of a finished request or of another attempt
            return
        before = pending.assembler.duplicates
        result = pending.assembler.add(chunk)
        if pending.assembler.duplicates > before:
            self.dropped_chunks += 1  # a duplicate is no progress (a replay brings many)
        else:
            pending.last_progress_mono = time.monotonic()
        if pending.assembler.duplicates == before and pending.on_tokens is not None and chunk.token_ids:
            pending.on_tokens(list(chunk.token_ids))
        if pending.assembler.duplicates == before and pending.on_chunk is not None:
            pending.on_chunk(chunk)
        if result is not None and not pending.done.done():
            pending.done.set_result(result)

    async def _on_stats(self, msg: Msg) -> None:
        try:
            stats = proto.decode_as(msg.data, EngineStats, msg.subject)
        except ProtoError:
            self.bad_messages += 1
            return
        self.directory.observe(stats, time.monotonic())
        self.control.on_stats(stats)

    async def abort(self, request_id: str, traj_id: str, reason: str = "") -> None:
        """Stop a turn on whichever engine holds it (or pulls it later): its `submit` then returns the partial
        output with finish_reason "abort", and the turn is never redelivered."""
        msg = AbortRequest(request_id=request_id, traj_id=traj_id, ts_s=self.clock.now_s(), reason=reason)
        await self.nc.publish(self.subjects.abort, proto.encode(msg))

    # --- the RL control plane (control.py) -------------------------------------------------------------------
    async def update_weights(
        self,
        version: int,
        source: str = "",
        *,
        timeout_s: float = 300.0,
        mode: str = "drain",
        transfer: dict[str, Any] | None = None,
    ) -> WeightsAck:
        """Make `version` the current policy version, its weights at `source` (a checkpoint directory under the
        engines' `--weights-root`; "" = reload their model path), and return once every live engine serves it.

        `mode` "drain" (synchronous RL): each engine stops pulling, finishes its held turns (within `timeout_s`;
        past it, it updates in flight), loads, resumes. "inflight" (asynchronous RL, AReaL, PipelineRL): each
        engine loads between two steps and running turns go on, every token stamped with the version that sampled
        it. The version is durable: an engine that starts or restarts loads it before pulling work.

        `transfer`: tensors instead of a checkpoint (vLLM's weight-transfer API, after `init_weight_transfer`):
        `{"update_info": ...}`, sent while the trainer broadcasts them (`weight_sync.BusWeightSyncClient` does both).

        Raises WeightUpdateError (`.engines`: the live engines that do not serve it — they failed to load it,
        `.failed` says why, or `timeout_s` ran out), ValueError (a version below the current one, a bad mode)."""
        return await self.control.update_weights(version, source, timeout_s, mode, transfer)

    async def init_weight_transfer(
        self,
        init_info: dict[str, Any],
        rank_offsets: dict[str, int] | None = None,
        *,
        timeout_s: float = 300.0,
    ) -> list[str]:
        """Have every live engine join the trainer's weight-transfer group (vLLM's API; engines started with a
        `weight_transfer_config`); `rank_offsets`: engine id → its first NCCL rank. Returns the engines once all
        joined; raises WeightUpdateError naming those that did not. Run it while the trainer opens its end."""
        return await self.control.init_weight_transfer(init_info, rank_offsets or {}, timeout_s)

    async def pause(self, reason: str = "", *, timeout_s: float = 30.0) -> list[str]:
        """Stop all generation cluster-wide: engines pull no more work and freeze their running turns; queued work
        waits, nothing is lost. Returns the live engines, once each reports paused. Raises PauseError naming the
        engines that did not within `timeout_s`."""
        return await self.control.set_paused(True, reason, timeout_s)

    async def resume(self, reason: str = "", *, timeout_s: float = 30.0) -> list[str]:
        """Undo `pause`: frozen turns go on where they stopped and engines pull again. Raises PauseError as `pause`."""
        return await self.control.set_paused(False, reason, timeout_s)

    async def abort_older_than(
        self, version: int, reason: str = "", *, timeout_s: float = 30.0
    ) -> list[GenerateResult]:
        """Abort every live turn (of every client) holding tokens of a policy version below `version`, or running
        on such weights, in one call. Returns this client's aborted turns: their partial outputs with per-token
        versions and finish_reason "abort" (their `generate` calls return the same results); a trainer resubmits
        them with the partial output appended (partial rollout, as APRIL and AReaL do). Raises TimeoutError when
        an aborted turn's final chunk does not come within `timeout_s`."""
        return await self.control.abort_older_than(version, reason, timeout_s)

    @property
    def context_bytes(self) -> int:
        """Bytes this client wrote to the context log."""
        return self.context_log.bytes

    def reply_subject(self, n: int) -> str:
        return f"{self._reply_prefix}.{n}"


def checked_sampling(sampling: SamplingParams | dict) -> SamplingParams:
    """`sampling` checked against the contract's bounds: a Struct's constructor does not check them, and an engine
    would refuse the turn only once published. Raises TypeError for an unknown key of a dict, ValueError naming the
    field for a value out of bounds (e.g. `top_logprobs` past 20)."""
    params = sampling if isinstance(sampling, SamplingParams) else SamplingParams(**sampling)
    try:
        return msgspec.convert(msgspec.to_builtins(params), SamplingParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"sampling: {exc}") from exc


def _with_attempt(req: GenerateRequest, attempt: int) -> GenerateRequest:
    import msgspec

    return msgspec.structs.replace(req, attempt=attempt)


@dataclass
class Trajectory:
    """One trajectory's turns and tool calls; keeps its turn counter, context length and engine affinity."""

    client: RolloutClient
    traj_id: str
    task: str
    policy_version: int
    turn: int = 0
    context_tokens: int = 0
    affinity_engine: str = ""
    results: list[GenerateResult] = field(default_factory=list)
    finished: bool = False
    last_context: list[int] = field(default_factory=list)  # the last turn's prompt + output ids
    prefix_broken: bool = False  # a prefix break was logged (once per trajectory)
    # Lean wire: the last prompt logged (a copy: a caller may extend its list in place) and its turn.
    _lean: LeanPrompts = field(default_factory=LeanPrompts, repr=False)

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | dict,
        *,
        on_tokens: Callable[[list[int]], None] | None = None,
        timeout_s: float | None = None,
        on_chunk: Callable[[TokenChunk], None] | None = None,
        min_policy_version: int = 0,
    ) -> GenerateResult:
        """Run one model turn on the whole context `prompt_token_ids`; returns its output ids, logprobs and the
        policy version of every token (`token_versions`).

        `on_tokens` sees each new batch of output ids as it streams; `on_chunk` each new `TokenChunk` whole
        (its ids with their logprobs and version, in arrival order). `min_policy_version`: the staleness bound, the
        oldest version whose weights may serve this turn (an engine on older weights never does). Raises ValueError
        for sampling outside the contract's bounds (before anything is sent), GenerateError when the engine rejects
        the turn (one is `version_unavailable`: no engine knows a version that new), TimeoutError when it makes no
        progress (after retries) or outlasts `timeout_s`.
        """
        return await self._run_turn(
            prompt_token_ids, sampling, None, on_tokens, timeout_s, on_chunk, min_policy_version
        )

    async def _run_turn(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | dict,
        hint: WorkloadHint | None,
        on_tokens: Callable[[list[int]], None] | None,
        timeout_s: float | None,
        on_chunk: Callable[[TokenChunk], None] | None = None,
        min_policy_version: int = 0,
    ) -> GenerateResult:
        """One turn; `hint` (the rollout driver's workload path, `workload_hint.generate_hinted`) or None."""
        if self.finished:
            raise RuntimeError(f"trajectory {self.traj_id} is finished")
        params = checked_sampling(sampling)
        self._check_prefix(prompt_token_ids)
        n = hint.prompt_len if hint is not None else len(prompt_token_ids)
        request_id = f"{self.traj_id}:{self.turn}"
        ids = list(prompt_token_ids)
        lean = self.client.lean_wire and bool(ids)
        wire = self._lean.plan(ids, self.client.inline_max_tokens) if lean else TurnWire(0, 0, ids, ids)
        req = GenerateRequest(
            request_id=request_id,
            traj_id=self.traj_id,
            turn=self.turn,
            prompt_token_ids=wire.inline,
            prompt_len=n,
            sampling=params,
            reply_to=self.client.reply_subject(self.turn),
            policy_version=self.policy_version,
            task=self.task,
            affinity_engine=self.affinity_engine,
            submitted_s=self.client.clock.now_s(),
            sim_output_tokens=hint.output_tokens if hint is not None else 0,
            sim_cacheable_tokens=hint.cacheable_tokens if hint is not None else 0,
            prefix_turn=wire.prefix_turn,
            prefix_len=wire.prefix_len,
            context_logged=lean,
            min_policy_version=min_policy_version,
        )
        self.client.check_payload(
            req
        )  # before anything is published: the tracker never sees a turn that cannot run
        if lean:
            await self.client.context_log.write(self.traj_id, self.turn, wire, self.client.nc.max_payload)
            self._lean.logged_as(self.turn, ids)
        await self.client.emit(
            TurnSubmitted,
            traj_id=self.traj_id,
            turn=self.turn,
            request_id=request_id,
            prompt_tokens=n,
            new_tokens=max(0, n - self.context_tokens),
        )
        result = await self.client.submit(
            req,
            on_tokens=on_tokens,
            timeout_s=timeout_s,
            new_tokens=max(0, n - self.context_tokens),
            on_chunk=on_chunk,
        )
        self.results.append(result)
        if prompt_token_ids:
            self.last_context = [*prompt_token_ids, *result.token_ids]
        self.affinity_engine = result.prefill_engine or result.engine_id
        self.context_tokens = n + len(result.token_ids)
        self.turn += 1
        return result

    def _check_prefix(self, prompt_token_ids: list[int]) -> None:
        """Token fidelity (DESIGN.md principle 9): a turn's prompt must extend the last prompt + output; a break
        (re-templated history, an edited observation) loses the engine's prefix cache and the exact tokens RL
        trains on. Counted in `client.prefix_breaks`, logged once per trajectory."""
        ctx = self.last_context
        if not ctx or not prompt_token_ids or prompt_token_ids[: len(ctx)] == ctx:
            return
        self.client.prefix_breaks += 1
        if not self.prefix_broken:
            self.prefix_broken = True
            at = next(
                (i for i, (a, b) in enumerate(zip(ctx, prompt_token_ids, strict=False)) if a != b),
                len(prompt_token_ids),
            )
            log.warning(
                "prefix_break", traj_id=self.traj_id, turn=self.turn, first_difference=at, context=len(ctx)
            )

    async def abort(self, reason: str = "") -> None:
        """Stop the turn running now (if any): its `generate` returns what was sampled so far, with
        finish_reason "abort"."""
        request_id = f"{self.traj_id}:{self.turn}"
        if request_id in self.client._pending:
            await self.client.abort(request_id, self.traj_id, reason)

    async def tool_started(self, tool: str = "") -> None:
        await self.client.emit(ToolCallStarted, traj_id=self.traj_id, turn=max(0, self.turn - 1), tool=tool)

    async def tool_finished(self, tool: str = "", observation_tokens: int = 0, ok: bool = True) -> None:
        await self.client.emit(
            ToolCallFinished,
            traj_id=self.traj_id,
            turn=max(0, self.turn - 1),
            tool=tool,
            observation_tokens=observation_tokens,
            ok=ok,
        )

    async def finish(self, reward: float | None = None, status: str = "finished") -> None:
        if self.finished:
            return
        self.finished = True
        await self.client.emit(
            TrajectoryFinished, traj_id=self.traj_id, status=status, reward=reward, turns=self.turn
        )
        if self._lean.logged:  # no turn will refer to its prompts any more
            self._lean = LeanPrompts()
            await self.client.context_log.purge(self.traj_id)

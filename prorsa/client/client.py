"""The asyncio client a trainer imports to roll out trajectories on a Prorsa cluster.

    client = await RolloutClient.connect("nats://127.0.0.1:4222")
    traj = await client.start_trajectory(task="coding", policy_version=3)
    out = await traj.generate(prompt_ids, SamplingParams(max_tokens=512))
    await traj.tool_started("bash"); ...; await traj.tool_finished("bash", observation_tokens=180)
    await traj.finish(reward=1.0)

It publishes the lifecycle events the tracker needs (with a per-client sequence number), sends each turn to the
engine that holds the trajectory's prefix when that engine can take it (else to the shared prefill queue), and
assembles the token stream exactly once (`stream.StreamAssembler`). Timestamps on the bus use the shared scaled
clock (`services.runtime.clock`); retry and staleness timers are wall-clock, as they guard against real outages. A request that shows no progress for
`retry_after_s` is republished with the same request_id and attempt+1; whichever copy completes first is the result
and the other's chunks are dropped, so a retry never duplicates a result.
Every subject it uses is documented in proto/README.md, so a trainer in another language can do the same.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

import proto
from prorsa.client.directory import EngineDirectory
from prorsa.client.stream import GenerateResult, StreamAssembler
from proto import (
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
from services.runtime import clock
from services.runtime.bus import connect, ensure_streams
from services.runtime.credentials import BusCredentials
from services.runtime.logging import get_logger

if TYPE_CHECKING:
    from prorsa.client.workload_hint import WorkloadHint


class GenerateError(RuntimeError):
    """The engine rejected the request (e.g. prompt longer than the model length); retrying will not help."""


@dataclass
class _Pending:
    assembler: StreamAssembler
    done: asyncio.Future[GenerateResult]
    last_progress_mono: float
    on_tokens: Callable[[list[int]], None] | None = None


class RolloutClient:
    def __init__(
        self,
        nc: NATS,
        namespace: str = "prorsa",
        client_id: str | None = None,
        retry_after_s: float = 120.0,
        max_attempts: int = 3,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = Subjects(namespace)
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:8]}"
        self.retry_after_s = retry_after_s
        self.max_attempts = max_attempts
        self.directory = EngineDirectory()
        self._seq = itertools.count(1)
        self._pending: dict[str, _Pending] = {}
        self._reply_prefix = self.subjects.reply(self.client_id)
        self._subs: list = []
        self.dropped_chunks = 0
        self.bad_messages = 0

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

    async def close(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        await self.nc.drain()

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def emit(self, make: Callable[..., LifecycleEvent], **fields: object) -> None:
        """Publish one lifecycle event into the EVENTS stream (JetStream-acked, so none is lost)."""
        msg = make(ts_s=clock.now_s(), source=self.client_id, seq=next(self._seq), **fields)
        await self.js.publish(
            self.subjects.lifecycle, proto.encode(msg), headers={"Nats-Msg-Id": f"{self.client_id}:{msg.seq}"}
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

    # --- generation -----------------------------------------------------------------------------------------
    async def submit(
        self,
        request: GenerateRequest,
        on_tokens: Callable[[list[int]], None] | None = None,
        timeout_s: float | None = None,
    ) -> GenerateResult:
        """Send a turn and wait for its whole output; retries a request that makes no progress."""
        pending = _Pending(
            StreamAssembler(request.request_id),
            asyncio.get_running_loop().create_future(),
            time.monotonic(),
            on_tokens,
        )
        self._pending[request.request_id] = pending
        deadline = time.monotonic() + timeout_s if timeout_s else None
        try:
            for attempt in range(self.max_attempts):
                req = request if attempt == 0 else _with_attempt(request, attempt)
                await self._publish_request(req)
                pending.last_progress_mono = time.monotonic()
                result = await self._wait(pending, deadline)
                if result is not None:
                    if result.error:
                        raise GenerateError(result.error)
                    return result
            raise TimeoutError(
                f"request {request.request_id} made no progress after {self.max_attempts} attempts"
            )
        finally:
            self._pending.pop(request.request_id, None)

    async def _wait(self, pending: _Pending, deadline: float | None) -> GenerateResult | None:
        """The result, or None when the request stalled for retry_after_s (then the caller retries)."""
        while True:
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise TimeoutError(f"request {pending.assembler.request_id} timed out")
            wait = self.retry_after_s - (now - pending.last_progress_mono)
            if wait <= 0:
                return None
            try:
                return await asyncio.wait_for(asyncio.shield(pending.done), timeout=min(wait, 1.0))
            except TimeoutError:
                continue

    async def _publish_request(self, req: GenerateRequest) -> None:
        target = (
            self.directory.affinity_target(req.affinity_engine, time.monotonic())
            if req.affinity_engine
            else None
        )
        subject = self.subjects.prefill_work_for(target) if target else self.subjects.prefill_work_any
        await self.js.publish(
            subject, proto.encode(req), headers={"Nats-Msg-Id": f"{req.request_id}#{req.attempt}"}
        )

    async def _on_chunk(self, msg: Msg) -> None:
        try:
            chunk = proto.decode_as(msg.data, TokenChunk, msg.subject)
        except ProtoError:
            self.bad_messages += 1
            return
        pending = self._pending.get(chunk.request_id)
        if pending is None:
            self.dropped_chunks += 1  # a late chunk of a finished request or of another attempt
            return
        pending.last_progress_mono = time.monotonic()
        before = pending.assembler.duplicates
        result = pending.assembler.add(chunk)
        if pending.assembler.duplicates > before:
            self.dropped_chunks += 1
        elif pending.on_tokens is not None and chunk.token_ids:
            pending.on_tokens(list(chunk.token_ids))
        if result is not None and not pending.done.done():
            pending.done.set_result(result)

    async def _on_stats(self, msg: Msg) -> None:
        try:
            self.directory.observe(proto.decode_as(msg.data, EngineStats, msg.subject), time.monotonic())
        except ProtoError:
            self.bad_messages += 1

    def reply_subject(self, n: int) -> str:
        return f"{self._reply_prefix}.{n}"


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

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | dict,
        *,
        on_tokens: Callable[[list[int]], None] | None = None,
        timeout_s: float | None = None,
    ) -> GenerateResult:
        """Run one model turn on the whole context `prompt_token_ids`; returns its output ids and logprobs.

        `on_tokens` sees each new batch of output ids as it streams. Raises GenerateError when the engine rejects
        the turn, TimeoutError when it makes no progress (after retries) or outlasts `timeout_s`.
        """
        return await self._run_turn(prompt_token_ids, sampling, None, on_tokens, timeout_s)

    async def _run_turn(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | dict,
        hint: WorkloadHint | None,
        on_tokens: Callable[[list[int]], None] | None,
        timeout_s: float | None,
    ) -> GenerateResult:
        """One turn; `hint` (the rollout driver's workload path, `workload_hint.generate_hinted`) or None."""
        if self.finished:
            raise RuntimeError(f"trajectory {self.traj_id} is finished")
        params = sampling if isinstance(sampling, SamplingParams) else SamplingParams(**sampling)
        n = hint.prompt_len if hint is not None else len(prompt_token_ids)
        request_id = f"{self.traj_id}:{self.turn}"
        await self.client.emit(
            TurnSubmitted,
            traj_id=self.traj_id,
            turn=self.turn,
            request_id=request_id,
            prompt_tokens=n,
            new_tokens=max(0, n - self.context_tokens),
        )
        req = GenerateRequest(
            request_id=request_id,
            traj_id=self.traj_id,
            turn=self.turn,
            prompt_token_ids=list(prompt_token_ids),
            prompt_len=n,
            sampling=params,
            reply_to=self.client.reply_subject(self.turn),
            policy_version=self.policy_version,
            task=self.task,
            affinity_engine=self.affinity_engine,
            submitted_s=clock.now_s(),
            sim_output_tokens=hint.output_tokens if hint is not None else 0,
            sim_cacheable_tokens=hint.cacheable_tokens if hint is not None else 0,
        )
        result = await self.client.submit(req, on_tokens=on_tokens, timeout_s=timeout_s)
        self.results.append(result)
        self.affinity_engine = result.prefill_engine or result.engine_id
        self.context_tokens = n + len(result.token_ids)
        self.turn += 1
        return result

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

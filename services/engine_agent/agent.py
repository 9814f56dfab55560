"""The engine agent service: one rollout engine on the bus.

It pulls generation work for its role (`puller.py`), runs it on its backend (`runner.py`), publishes phase and
progress events on `events.<engine_id>` and `EngineStats` every second on `stats.<engine_id>`, switches role on
`RoleSwitchCommand`s (request/reply on `cmd.<engine_id>`, epoch-fenced by `role_state.py`, run by `switch_drain.py`:
in place, or drained and restarted where the new role's layout differs; the ack is the reply and is also published
on `ack.<engine_id>`), and serves the policy version the trainer made current (`weights.py`: read from the policy KV
bucket before it pulls any work, watched after; drain or in-flight loads, pause/resume, abort by version,
`WeightsStatus` for the trainer's barrier).

Roles: `prefill` takes GenerateRequests and hands their KV to the decode queue; `decode` takes DecodeHandoffs and
streams tokens; `mixed` (colocation) takes GenerateRequests and decodes them itself, and takes handoffs when it has
no prefill work.

Time: every timestamp (`ts_s`), duration and rate the agent publishes is in scaled seconds read from its engine's
`Clock` (`backend.clock`, wall seconds × the time scale; see `services.runtime.clock`), the one notion of a second
shared across the bus. The runner, the puller and the switch drain read the agent's `clock` too.
Fixed cadences of the agent's own loops (stats, progress, polls, heartbeats against JetStream's ack_wait) stay in
wall seconds: they pace I/O, not the modelled engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS

from proto import (
    AbortOlderThan,
    AbortRequest,
    EngineStats,
    Message,
    PolicyVersionUpdate,
    RequestFinished,
    RoleSwitchAck,
    RoleSwitchCommand,
    check_token,
)
from services.engine_agent.backend import Backend, BackendError, EngineDead
from services.engine_agent.context_cache import DEFAULT_MAX_TOKENS as DEFAULT_CONTEXT_CACHE_TOKENS
from services.engine_agent.context_cache import ContextCache
from services.engine_agent.contexts import ContextResolver
from services.engine_agent.metrics import EngineMetrics
from services.engine_agent.pull_capacity import PullConfig
from services.engine_agent.puller import WorkPuller
from services.engine_agent.rescue import AddressedRescue
from services.engine_agent.role_state import (
    DEFAULT_MAX_EPOCH_JUMP,
    initial_state,
    on_command,
    on_switch_done,
    on_switch_failed,
)
from services.engine_agent.runner import JobRunner
from services.engine_agent.switch_drain import hand_off_all, run_switch, wait_jobs
from services.engine_agent.weights import WeightsControl
from services.engine_agent.weights_guard import DEFAULT_MAX_VERSION_JUMP
from services.runtime.bus import BUS_ERRORS
from services.runtime.service import Service

# Wall seconds the backlog loop waits for its addressed queue's pending count (a JetStream request); the stats carry
# the previous count meanwhile.
STATS_QUERY_S = 0.5
BACKLOG_INTERVAL_S = 1.0  # wall seconds between two reads of that count (stats go out more often in tests)
# Wall seconds a dead engine's jobs get to hand themselves on (vLLM fails their streams at once) before the agent
# hands them on itself.
DEAD_ENGINE_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class AgentConfig:
    role: str = "mixed"  # role at start-up
    profile: str = (
        ""  # performance profile reported in EngineStats (built-in name or profile file; "" unknown)
    )
    # Wall seconds (I/O cadences and server-side timeouts, see the module docstring):
    # JetStream ack_wait of the work consumers (in_progress() every third of it): how long work held by an engine
    # that died waits before JetStream hands it to another one, so it is short (see rescue.py, "Timing").
    ack_wait_s: float = 3.0
    stats_interval_s: float = 1.0  # EngineStats publishing interval (its rates are per scaled second)
    peer_dead_after_s: float | None = None  # a peer silent this long is dead (None: 3 stats intervals, ≥ 1 s)
    progress_interval_s: float = 0.1  # TokenProgress batching interval
    chunk_interval_s: float = 0.02  # at most one TokenChunk per request per interval
    prefill_budget_tokens: int = 32_768  # prompt tokens held for prefill at most (prefill and mixed roles)
    max_fetch: int = 16
    own_poll_s: float = 0.02  # mixed role: the short poll of the decode queues (see puller.py)
    any_poll_s: float = 0.25  # every queue's long poll: paces only idle fetches, never delays a message
    stop_timeout_s: float = 10.0  # wall seconds: graceful stop, time to hand on held work (publish and ack)
    # Bounds on what a command or update may ask (role_state.py, weights_guard.py):
    max_epoch_jump: int = DEFAULT_MAX_EPOCH_JUMP
    max_version_jump: int = DEFAULT_MAX_VERSION_JUMP
    weights_root: str = ""  # weights_path must lie under it ("": only reloads from the model path)
    # Health of the engine itself (wall seconds): how long it may take to start before the agent gives up and
    # exits (None: no limit), and how often the liveness probe asks it whether it still serves.
    start_timeout_s: float | None = None
    liveness_interval_s: float = 2.0
    context_cache_tokens: int = (
        DEFAULT_CONTEXT_CACHE_TOKENS  # prompts held for the lean wire (context_cache.py)
    )


class EngineAgent(Service):
    name = "engine_agent"

    def __init__(
        self,
        nats_url: str,
        namespace: str = "prorsa",
        *,
        engine_id: str,
        backend: Backend,
        config: AgentConfig | None = None,
        instance_id: str | None = None,
        metrics_port: int | None = None,
    ) -> None:
        check_token(engine_id, "engine id")
        # One clock for the agent and its engine (their stamps and durations are compared with each other).
        super().__init__(
            nats_url, namespace, instance_id or f"engine_agent-{engine_id}", metrics_port, backend.clock
        )
        self.engine_id = engine_id
        self.backend = backend
        self.domain_metrics = EngineMetrics(self.metrics, engine_id)
        self.config = config or AgentConfig()
        self.role_state = initial_state(engine_id, self.config.role, self.config.max_epoch_jump)
        self.last_switch_s = 0.0
        self.contexts = ContextResolver(
            self._connection, self.subjects, ContextCache(self.config.context_cache_tokens)
        )
        self.runner = JobRunner(self, self.config.chunk_interval_s)
        self.puller = WorkPuller(
            self,
            self.runner,
            PullConfig(
                ack_wait_s=self.config.ack_wait_s,
                own_poll_s=self.config.own_poll_s,
                any_poll_s=self.config.any_poll_s,
                max_fetch=self.config.max_fetch,
                prefill_budget_tokens=self.config.prefill_budget_tokens,
            ),
        )
        dead_after_s = self.config.peer_dead_after_s or max(1.0, 3 * self.config.stats_interval_s)
        self.rescue = AddressedRescue(self, dead_after_s)
        self.reconfig_lock = asyncio.Lock()  # one backend reconfiguration (role or weights) at a time
        self._waiters: dict[int, list[str]] = {}  # epoch -> reply subjects waiting for its ack
        self._event_seq = 0
        self.weights = WeightsControl(self)
        self._stats_prev = (self.clock.monotonic_s(), 0, 0, 0)
        self._hit_rate = 0.0
        self._addressed_waiting = 0  # the addressed queue's backlog, as of the last stats loop (EngineStats)
        self._handed_off = False
        self._serving = False  # set once setup() completed: only then is there work to hand off
        self.engine_failure = ""  # why the engine died ("" while it lives): see `engine_dead`; exit_code 1

    @property
    def role(self) -> str:
        return self.role_state.role

    @property
    def policy_version(self) -> int:
        """The version whose weights serve now (the backend's: it switches between two engine steps)."""
        return int(self.backend.policy_version)

    def _connection(self) -> NATS:
        assert self.nc is not None, "the context log is read only while connected"
        return self.nc

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def setup(self) -> None:
        # Health answers from before setup() (Service.start subscribes first), and a real engine takes a minute
        # to load: report "degraded" (details: starting=True) until the engine serves, so `prorsa up` and
        # `prorsa status` do not call a loading engine healthy.
        self.status = "degraded"
        # From now on the weights barrier sees this engine, as "starting" until it serves the current version.
        self.spawn(self.weights.status_loop(self.config.stats_interval_s), name="weights_status")
        try:
            await asyncio.wait_for(self.backend.start(), self.config.start_timeout_s)
        except TimeoutError:
            raise BackendError(
                f"engine {self.engine_id} did not start within {self.config.start_timeout_s:.0f} s"
            ) from None
        await self.weights.start()  # the current policy version (and pause flag) before any work is pulled
        await self.puller.setup()
        await self.subscribe(
            self.subjects.engine_command(self.engine_id), self._on_command, RoleSwitchCommand
        )
        await self.subscribe(self.subjects.policy_version, self.weights.on_core_update, PolicyVersionUpdate)
        await self.subscribe(self.subjects.all_engine_stats, self.rescue.on_stats, EngineStats)
        await self.subscribe(self.subjects.abort, self._on_abort, (AbortRequest, AbortOlderThan))
        self.spawn(self.puller.run(), name="pull")
        self.spawn(self.rescue.run(), name="rescue")
        self.spawn(self.runner.heartbeat_loop(max(0.05, self.config.ack_wait_s / 3)), name="heartbeat")
        self.spawn(self.runner.progress_loop(self.config.progress_interval_s), name="progress")
        self.spawn(self._stats_loop(), name="stats")
        self.spawn(self._backlog_loop(), name="backlog")
        self.spawn(self._liveness_loop(), name="liveness")
        assert self.nc is not None
        await self.nc.flush()  # the server has our subscriptions: a command sent after start() finds us
        self._serving = True
        self.status = "ok"
        self.log.info("engine_ready", engine_id=self.engine_id, role=self.role, backend=self.backend.name)

    async def stop(self) -> None:
        """Graceful stop: hand on every held request first (exact migration), then the Service's stop."""
        try:
            if self._serving and not self._handed_off and self.nc is not None and self.nc.is_connected:
                self._handed_off = True
                await self.weights.release()  # a paused engine must run again to hand its frozen turns on
                moved = await hand_off_all(self, self.config.stop_timeout_s)
                self.log.info("work_handed_off_at_stop", requests=moved)
        except (BackendError, *BUS_ERRORS) as exc:  # what was not handed on is redelivered after ack_wait
            self.metrics.count_error("hand_off")
            self.log.warning("hand_off_failed", error=repr(exc))
        finally:  # even past our own bug, which then propagates: the engine and the connection are closed
            await super().stop()

    async def teardown(self) -> None:
        await self.rescue.close()
        await self.puller.close()
        await self.backend.close()

    # -- a dead engine ---------------------------------------------------------------------------------------------

    def engine_dead(self, exc: BaseException) -> None:
        """The engine can serve no more (a job or the liveness probe found it dead): report it (health
        `unhealthy`, details `engine: failed`), stop pulling, let every held job hand its work on, then stop with
        exit status 1 so the supervisor (`prorsa up`, compose's restart policy) starts a fresh agent and engine.
        Idempotent."""
        if self.engine_failure:
            return
        self.engine_failure = repr(exc)[:300]
        self.status = "unhealthy"
        self.puller.pause("engine_dead")
        self.metrics.count_error("engine_dead")
        self.log.error("engine_dead", engine_id=self.engine_id, error=self.engine_failure)
        self.spawn(self._leave_dead(), name="engine_dead")

    async def _leave_dead(self) -> None:
        await self.puller.wait_idle(self.config.stop_timeout_s)
        # A dead engine fails every stream it had, and each job then hands its work on (runner) and ends; one whose
        # stream the engine never ends is handed on from outside after a short grace.
        jobs = list(self.runner.jobs.values())
        await wait_jobs(jobs, DEAD_ENGINE_GRACE_S)
        for job in jobs:
            try:
                await self.runner.hand_on_abandoned(job)
            except BUS_ERRORS as exc:  # not stored: redelivered by JetStream after ack_wait instead
                self.metrics.count_error("hand_off")
                self.log.warning("hand_off_failed", request_id=job.request_id, error=repr(exc))
        self.exit_code = 1
        self.request_stop()

    async def _liveness_loop(self) -> None:
        while not self.engine_failure:
            await asyncio.sleep(self.config.liveness_interval_s)  # wall cadence
            try:
                await self.backend.check_alive()
            except EngineDead as exc:
                self.engine_dead(exc)

    def health_details(self) -> dict[str, Any]:
        return {
            "engine": "failed" if self.engine_failure else ("starting" if not self._serving else "ok"),
            **({"engine_error": self.engine_failure} if self.engine_failure else {}),
            "engine_id": self.engine_id,
            "role": self.role,
            "epoch": self.role_state.applied_epoch,
            "switching": self.role_state.switching,
            "held_requests": len(self.runner.jobs),
            "policy_version": self.policy_version,
            "weights": self.weights.state.phase,
            "paused": self.weights.state.paused,
            "backend": self.backend.name,
            "max_model_len": self.backend.max_model_len,
            "starting": not self._serving,
            "rescued_messages": self.rescue.moved,
            "returned_messages": self.puller.returned,  # fetched for a role it left (an in-place switch)
            "context_cache": {
                "trajectories": len(self.contexts.cache),
                "tokens": self.contexts.cache.tokens,
                "hits": self.contexts.cache.hits,
                "misses": self.contexts.cache.misses,
                "log_reads": self.contexts.log_reads,
            },
        }

    # -- events --------------------------------------------------------------------------------------------------

    async def emit(self, cls: type[Message], **fields: Any) -> None:
        """Publish an engine event (PrefillDone, TokenProgress, ...) into the EVENTS stream, numbered per engine."""
        self._event_seq += 1
        msg = cls(engine_id=self.engine_id, ts_s=self.clock.now_s(), seq=self._event_seq, **fields)  # type: ignore[call-arg]
        if isinstance(msg, RequestFinished):
            self.domain_metrics.on_finished(msg)
        try:
            # A short wait: an event is an observation, and a job waiting on it holds its stream meanwhile.
            await self.js_publish(self.subjects.engine_events(self.engine_id), msg, wait_s=5.0)
        except BUS_ERRORS as exc:  # the stream is unavailable: the event is lost, the work goes on
            self.metrics.count_error("event_publish")
            self.log.warning("event_publish_failed", message_type=type(msg).__name__, error=repr(exc))

    async def _on_abort(self, msg: Message, raw: Any) -> None:
        if isinstance(msg, AbortOlderThan):
            await self.weights.on_abort_older(msg, raw)
            return
        assert isinstance(msg, AbortRequest)
        self.log.info("abort_requested", request_id=msg.request_id, held=msg.request_id in self.runner.jobs)
        await self.runner.abort_request(msg.request_id)

    # -- role switches -------------------------------------------------------------------------------------------

    async def _on_command(self, cmd: Message, raw: Any) -> None:
        assert isinstance(cmd, RoleSwitchCommand)
        self.role_state, d = on_command(self.role_state, cmd, self.clock.now_s())
        self.log.info("role_command", epoch=cmd.epoch, role=cmd.role, decision=d.kind)
        if d.kind == "rejected":
            await self.reject(raw, d.error_kind, d.error)
            return
        if d.ack is not None:  # replay of the completed epoch, or a stale command
            if d.kind == "stale":
                self.metrics.count_error("stale_command")
            await self._answer(d.ack, [raw.reply] if raw.reply else [])
            return
        if raw.reply:
            self._waiters.setdefault(cmd.epoch, []).append(raw.reply)
        if d.superseded is not None:
            await self._answer(d.superseded, self._waiters.pop(d.superseded.epoch, []))
        if d.start is not None:
            self.puller.pause("switch")
            self.spawn(self._run_switches(d.start), name="switch")

    async def _run_switches(self, cmd: RoleSwitchCommand | None) -> None:
        """Execute the accepted switch, then any command queued meanwhile; resume pulling in the final role."""
        try:
            while cmd is not None:
                try:
                    async with self.reconfig_lock:
                        migrated, drained = await run_switch(self, cmd)
                except (BackendError, *BUS_ERRORS) as exc:  # the engine or the bus failed the switch
                    self.metrics.count_error("switch")
                    self.log.error("role_switch_failed", epoch=cmd.epoch, error=repr(exc))
                    self.role_state, ack, cmd = on_switch_failed(
                        self.role_state, self.clock.now_s(), repr(exc)
                    )
                except Exception as exc:
                    # Broad on purpose: the command must still get its (failed) ack, or the engine would stay
                    # "switching" and refuse every later command. Our bug is surfaced (logged, counted, in health).
                    self.note_bug("switch", exc, epoch=cmd.epoch)
                    self.role_state, ack, cmd = on_switch_failed(
                        self.role_state, self.clock.now_s(), repr(exc)
                    )
                else:
                    self.clear_bug("switch")
                    self.role_state, ack, cmd = on_switch_done(
                        self.role_state, self.clock.now_s(), migrated, drained
                    )
                    self.last_switch_s = ack.switch_s
                self.log.info(
                    "role_switched", role=self.role, epoch=ack.epoch, ok=ack.ok, switch_s=ack.switch_s
                )
                await self._answer(ack, self._waiters.pop(ack.epoch, []))
        finally:
            self.puller.resume("switch")

    async def _answer(self, ack: RoleSwitchAck, replies: list[str]) -> None:
        for reply in replies:
            with contextlib.suppress(*BUS_ERRORS):
                await self.publish(reply, ack)
        with contextlib.suppress(*BUS_ERRORS):
            await self.publish(self.subjects.engine_ack(self.engine_id), ack)

    # -- stats ---------------------------------------------------------------------------------------------------

    async def _backlog_loop(self) -> None:
        """Keeps `_addressed_waiting` (EngineStats.addressed_waiting) current in its own loop: a JetStream request
        at most once a second, so the stats themselves never wait on the bus's answer."""
        while True:
            with contextlib.suppress(
                *BUS_ERRORS, TimeoutError
            ):  # the last figure stands until the bus answers
                self._addressed_waiting = await asyncio.wait_for(
                    self.puller.addressed_backlog(), STATS_QUERY_S
                )
            await asyncio.sleep(max(self.config.stats_interval_s, BACKLOG_INTERVAL_S))

    async def _stats_loop(self) -> None:
        while True:
            stats = self.stats_snapshot()
            self.domain_metrics.observe(stats, self.runner.prefill_new_tokens, self.runner.decode_tokens)
            with contextlib.suppress(*BUS_ERRORS):
                await self.publish(self.subjects.engine_stats(self.engine_id), stats)
            await asyncio.sleep(self.config.stats_interval_s)  # wall cadence, see AgentConfig

    def stats_snapshot(self) -> EngineStats:
        """EngineStats now; token rates are per scaled second over the time since the previous snapshot."""
        r = self.runner
        now = self.clock.monotonic_s()
        t0, new0, cached0, dec0 = self._stats_prev
        self._stats_prev = (now, r.prefill_new_tokens, r.prefill_cached_tokens, r.decode_tokens)
        dt = max(now - t0, 1e-6)
        new, cached = r.prefill_new_tokens - new0, r.prefill_cached_tokens - cached0
        if new + cached > 0:
            self._hit_rate = cached / (new + cached)
        b = self.backend.stats()
        return EngineStats(
            engine_id=self.engine_id,
            ts_s=self.clock.now_s(),
            role=self.role,  # type: ignore[arg-type]
            epoch=self.role_state.applied_epoch,
            backend=self.backend.name,
            running=b.running,
            waiting=b.waiting,
            kv_used_tokens=max(0, b.kv_used_tokens),
            kv_capacity_tokens=b.kv_capacity_tokens,
            prefill_tokens_per_s=new / dt,
            decode_tokens_per_s=(r.decode_tokens - dec0) / dt,
            prefix_hit_rate=self._hit_rate,
            policy_version=self.policy_version,
            switching=self.role_state.switching,
            last_switch_s=self.last_switch_s,
            in_flight_tokens=r.in_flight_tokens(),
            prefix_cache_tokens=max(0, b.prefix_cache_tokens),
            profile=self.config.profile,
            addressed_waiting=self._addressed_waiting,
            restart_roles=list(b.restart_roles),  # type: ignore[arg-type]
        )

"""The engine agent service: one rollout engine on the bus.

It pulls generation work for its role (`puller.py`), runs it on its backend (`runner.py`), publishes phase and
progress events on `events.<engine_id>` and `EngineStats` every second on `stats.<engine_id>`, switches role on
`RoleSwitchCommand`s (request/reply on `cmd.<engine_id>`, epoch-fenced by `role_state.py`, drained by
`switch_drain.py`; the ack is the reply and is also published on `ack.<engine_id>`), and picks up new weights
announced on `policy.version` between requests.

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

from proto import (
    AbortRequest,
    EngineStats,
    Message,
    PolicyVersionUpdate,
    RequestFinished,
    RoleSwitchAck,
    RoleSwitchCommand,
    check_token,
)
from services.engine_agent.backend import Backend, BackendError
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
from services.engine_agent.switch_drain import drain_for_switch, hand_off_all
from services.engine_agent.weights_guard import DEFAULT_MAX_VERSION_JUMP, check_update, resolve
from services.runtime.bus import BUS_ERRORS
from services.runtime.service import Service


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
    # Scaled seconds (waiting for generation, which runs on the scaled clock):
    weights_drain_timeout_s: float = 10.0  # a weight update waits this long for held requests to finish
    stop_timeout_s: float = 10.0  # wall seconds: graceful stop, time to hand on held work (publish and ack)
    # Bounds on what a command or update may ask (role_state.py, weights_guard.py):
    max_epoch_jump: int = DEFAULT_MAX_EPOCH_JUMP
    max_version_jump: int = DEFAULT_MAX_VERSION_JUMP
    weights_root: str = ""  # weights_path must lie under it ("": only reloads from the model path)


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
        self.policy_version = 0
        self.last_switch_s = 0.0
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
        self._pending_update: PolicyVersionUpdate | None = None
        self._weights_task: asyncio.Task[Any] | None = None
        self._stats_prev = (self.clock.monotonic_s(), 0, 0, 0)
        self._hit_rate = 0.0
        self._handed_off = False
        self._serving = False  # set once setup() completed: only then is there work to hand off

    @property
    def role(self) -> str:
        return self.role_state.role

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def setup(self) -> None:
        # Health answers from before setup() (Service.start subscribes first), and a real engine takes a minute
        # to load: report "degraded" (details: starting=True) until the engine serves, so `prorsa up` and
        # `prorsa status` do not call a loading engine healthy.
        self.status = "degraded"
        await self.backend.start()
        await self.puller.setup()
        await self.subscribe(
            self.subjects.engine_command(self.engine_id), self._on_command, RoleSwitchCommand
        )
        await self.subscribe(self.subjects.policy_version, self._on_policy, PolicyVersionUpdate)
        await self.subscribe(self.subjects.all_engine_stats, self.rescue.on_stats, EngineStats)
        await self.subscribe(self.subjects.abort, self._on_abort, AbortRequest)
        self.spawn(self.puller.run(), name="pull")
        self.spawn(self.rescue.run(), name="rescue")
        self.spawn(self.runner.heartbeat_loop(max(0.05, self.config.ack_wait_s / 3)), name="heartbeat")
        self.spawn(self.runner.progress_loop(self.config.progress_interval_s), name="progress")
        self.spawn(self._stats_loop(), name="stats")
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

    def health_details(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "role": self.role,
            "epoch": self.role_state.applied_epoch,
            "switching": self.role_state.switching,
            "held_requests": len(self.runner.jobs),
            "policy_version": self.policy_version,
            "backend": self.backend.name,
            "starting": not self._serving,
            "rescued_messages": self.rescue.moved,
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
                        migrated, drained = await drain_for_switch(self, cmd)
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

    # -- weights -------------------------------------------------------------------------------------------------

    async def _on_policy(self, update: Message, raw: Any) -> None:
        assert isinstance(update, PolicyVersionUpdate)
        pending = self._pending_update.version if self._pending_update is not None else 0
        newest = max(self.policy_version, pending)
        if update.version <= newest:
            return  # old news
        refusal = check_update(update, newest, self.config.max_version_jump, self.config.weights_root)
        if refusal is not None:
            await self.reject(
                raw,
                refusal.kind,
                refusal.error,
                field="version" if refusal.kind == "version_jump" else "weights_path",
            )
            return
        self._pending_update = update
        if self._weights_task is None or self._weights_task.done():
            self._weights_task = self.spawn(self._apply_weights(), name="weights")

    async def _apply_weights(self) -> None:
        """Between requests: stop pulling, let held requests finish (bounded), reload, resume."""
        while (update := self._pending_update) is not None:
            self._pending_update = None
            if update.version <= self.policy_version:
                continue
            self.puller.pause("weights")
            try:
                await self.puller.wait_idle()
                deadline_s = self.clock.monotonic_s() + self.config.weights_drain_timeout_s
                while self.runner.jobs and self.clock.monotonic_s() < deadline_s:
                    await asyncio.sleep(0.02)  # a wall-time poll interval
                async with self.reconfig_lock:
                    path = resolve(update.weights_path, self.config.weights_root)
                    await self.backend.reload_weights(update.version, path)
                self.policy_version = update.version
                self.log.info("weights_updated", version=update.version)
            except BackendError as exc:  # the engine could not load them: it keeps serving the old weights
                self.metrics.count_error("weights")
                self.log.error("weights_update_failed", version=update.version, error=repr(exc))
            finally:
                self.puller.resume("weights")

    # -- stats ---------------------------------------------------------------------------------------------------

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
        )

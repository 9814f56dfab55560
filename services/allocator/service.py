"""The allocator service: engine stats and forecasts in, epoch-fenced role-switch commands and plans out.

Every `interval_s` (scaled seconds, on `self.clock`) it
1. forgets commands whose ack is overdue (logged; never re-sent as such — `SwitchCoordinator` rule 2);
2. builds a `ClusterView` from *fresh* engine stats only (received within `stale_after_s`; stats stamped in the
   future or older than that bound are dropped on arrival), the WORK stream's depth, the request-level load seen on
   the bus since the last decision (lifecycle and engine events: request counts and sizes, as Dynamo's planner
   observes them), and the latest forecast if it is fresh — the one road demand takes to the policy: its outlook
   carries the live trajectories and the turns ahead, and the service reads no tracker snapshot;
3. asks the policy (`decide`) — or, in the start-up phase, applies the policy's `initial_plan` to the engines that
   are idle (a restarted allocator does not upset engines that are working);
4. turns the target roles into commands through the `SwitchCoordinator` (stale engines left alone, one command in
   flight per engine, increasing epochs, never an empty role with demand, bounded churn);
5. sends each command as a NATS request to `cmd.<engine_id>`; the reply is a `RoleSwitchAck`. A timeout is logged
   and counted, and the command stays outstanding until its ack, stats showing its epoch, or `ack_timeout_s` — a
   missing ack is never blindly retried;
6. publishes an `AllocationPlan` (every fresh engine's role as the allocator intends it) on `allocator.plan`.

Between decisions, each acknowledged switch lets the coordinator send what its budget then allows of the last
target (`SwitchCoordinator.follow_up`): a move staged a quarter of the fleet at a time goes on as its switches land.

An acknowledged switch counts as applied until the engine's stats show its epoch, so the next decision does not
undo or repeat it. Bad input on any consumed subject is rejected by the `Service` base (logged, counted, answered);
stats whose subject and engine id disagree are rejected too.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from typing import Any

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

import proto
from proto import (
    ENGINE_EVENT_MESSAGES,
    LIFECYCLE_MESSAGES,
    ROLES,
    AllocationPlan,
    DemandForecast,
    EngineStats,
    Message,
    PrefillDone,
    ProtoError,
    RequestFinished,
    RoleSwitchAck,
    RoleSwitchCommand,
    TurnSubmitted,
)
from services.allocator.capacity import ModelProfile, resolve_profile
from services.allocator.metrics import AllocatorMetrics
from services.allocator.observed import QueueDepth, RecentLoad, build_view
from services.allocator.policies.common import role_demand
from services.allocator.policy import AllocatorPolicy, ClusterView, PolicyError
from services.allocator.registry import make_policy, policy_names
from services.allocator.switch_coordinator import DRAIN_TIMEOUT_S, SwitchCoordinator
from services.runtime.bus import BUS_ERRORS
from services.runtime.clock import Clock
from services.runtime.service import Service


class AllocatorService(Service):
    name = "allocator"

    def __init__(
        self,
        nats_url: str,
        namespace: str = "prorsa",
        instance_id: str | None = None,
        metrics_port: int | None = None,
        *,
        policy: str | AllocatorPolicy = "prorsa",
        profile: object | None = None,
        interval_s: float | None = None,
        n_engines: int | None = None,
        stale_after_s: float = 5.0,
        ack_timeout_s: float = 60.0,
        command_timeout_s: float = 45.0,
        forecast_stale_s: float = 30.0,
        clock_skew_s: float = 2.0,
        max_concurrent_fraction: float = 0.25,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        initial_phase_s: float = 30.0,
        observe_events: bool = True,
        clock: Clock | None = None,
    ) -> None:
        """Raises PolicyError (unknown policy) or ValueError (unknown profile) at once, not at the first tick."""
        super().__init__(nats_url, namespace, instance_id, metrics_port, clock)
        if isinstance(policy, str) and policy.split(":")[0] not in policy_names():
            raise PolicyError(f"unknown policy {policy!r}; known: {', '.join(policy_names())}")
        # "auto" (or None): the profile the engines report (EngineStats.profile), else the default
        self._profile_auto = profile is None or profile == "auto"
        self.profile = resolve_profile(None if self._profile_auto else profile)
        self.policy_spec = policy if isinstance(policy, str) else policy.name
        self.policy: AllocatorPolicy | None = None if isinstance(policy, str) else policy
        self.n_engines = n_engines
        self._interval_s = interval_s
        self.coord = SwitchCoordinator(
            stale_after_s=stale_after_s,
            ack_timeout_s=ack_timeout_s,
            max_concurrent_fraction=max_concurrent_fraction,
            drain_timeout_s=drain_timeout_s,
        )
        self.command_timeout_s = command_timeout_s
        self.forecast_stale_s = forecast_stale_s
        self.clock_skew_s = clock_skew_s
        self.initial_phase_s = initial_phase_s
        self.observe_events = observe_events
        self.recent = RecentLoad()
        self.forecast: DemandForecast | None = None
        self._forecast_rx_s = 0.0
        self._initial: dict[str, str] | None = None
        self._initial_until_s = 0.0
        self._initial_done = False
        self.counters = {
            "switches_issued": 0,
            "command_timeouts": 0,
            "no_responders": 0,
            "bad_acks": 0,
            "stale_stats": 0,
            "decisions": 0,
            "policy_errors": 0,
            "plans_published": 0,
        }
        self.last_decision_ms = 0.0
        self.last_view: ClusterView | None = None
        self.domain_metrics = AllocatorMetrics(self.metrics)

    @property
    def interval_s(self) -> float:
        if self._interval_s is not None:
            return self._interval_s
        return self.policy.interval_s if self.policy is not None else 5.0

    # --- wiring -------------------------------------------------------------------------------------------------
    async def setup(self) -> None:
        s = self.subjects
        await self.subscribe(s.all_engine_stats, self._on_stats, EngineStats)
        await self.subscribe(s.all_engine_acks, self._on_ack, RoleSwitchAck)
        await self.subscribe(s.forecast, self._on_forecast, DemandForecast)
        if self.observe_events:
            await self.subscribe(s.lifecycle, self._on_lifecycle, LIFECYCLE_MESSAGES)
            await self.subscribe(s.all_engine_events, self._on_engine_event, ENGINE_EVENT_MESSAGES)
        assert self.nc is not None
        await (
            self.nc.flush()
        )  # the server knows every subscription before start() returns: nothing sent after is lost
        self.spawn(self._loop(), name="allocator-loop")

    def health_details(self) -> dict[str, Any]:
        now = self.clock.now_s()
        return {
            "policy": self.policy.name if self.policy is not None else self.policy_spec,
            "profile": self.profile.name,
            "epoch": self.coord.epoch,
            "engines_seen": len(self.coord.stats),
            "engines_fresh": len(self.coord.fresh_engines(now)),
            "outstanding_commands": len(self.coord.outstanding),
            "ack_timeouts": self.coord.timeouts,
            "refused": self.coord.refused,
            "last_decision_ms": round(self.last_decision_ms, 3),
            **self.counters,
        }

    # --- inputs -------------------------------------------------------------------------------------------------
    async def _on_stats(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, EngineStats)
        now = self.clock.now_s()
        if raw.subject.rsplit(".", 1)[-1] != msg.engine_id:
            await self.reject(
                raw, "invalid_request", f"stats for {msg.engine_id} on {raw.subject}", "engine_id"
            )
            return
        if not math.isfinite(msg.ts_s) or msg.ts_s > now + self.clock_skew_s:
            # A future stamp would make every later (true) report look out of order to the coordinator.
            await self.reject(raw, "invalid_request", f"stats stamped in the future: ts_s={msg.ts_s}", "ts_s")
            return
        if now - msg.ts_s > self.coord.stale_after_s + self.clock_skew_s:
            self.counters["stale_stats"] += 1  # a late or replayed report: never act on it
            return
        self.coord.observe_stats(msg, now)

    async def _on_ack(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, RoleSwitchAck)
        self._apply_ack(msg)

    def _apply_ack(self, ack: RoleSwitchAck) -> bool:
        """Fold an ack in; False (counted, logged) for an epoch this allocator never issued nor saw applied."""
        if ack.epoch > self.coord.epoch:  # another allocator, or a forgery: it must not move our epochs
            self.counters["bad_acks"] += 1
            self.log.warning("bad_ack", engine=ack.engine_id, epoch=ack.epoch, error="epoch never issued")
            return False
        now = self.clock.now_s()
        if self.coord.observe_ack(ack, now):
            # a staged move goes on now, not at the next decision (SwitchCoordinator.follow_up)
            self._issue(self.coord.follow_up(now), self.coord.goal_reason)
        return True

    async def _on_forecast(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, DemandForecast)
        self.forecast, self._forecast_rx_s = msg, self.clock.now_s()

    async def _on_lifecycle(self, msg: Message, raw: Msg) -> None:
        if isinstance(msg, TurnSubmitted):
            self.recent.observe_turn(msg.new_tokens, msg.prompt_tokens)

    async def _on_engine_event(self, msg: Message, raw: Msg) -> None:
        if isinstance(msg, PrefillDone):
            self.recent.observe_prefill(msg.new_tokens, msg.cached_tokens, msg.away)
        elif isinstance(msg, RequestFinished):
            self.recent.observe_finished(msg.output_tokens)

    # --- the decision loop --------------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while not self.stopping:
            await self.clock.sleep_s(self.interval_s)  # the policy's interval is in (scaled) seconds
            try:
                await self.tick()
            except BUS_ERRORS as exc:  # the plan could not be published: the next tick decides again
                self.metrics.count_error("tick_bus")
                self.log.warning("tick_bus_error", error=repr(exc))
            except Exception as exc:
                # Broad on purpose: a dead decision loop would freeze every engine in its role, silently. Our
                # bug is surfaced instead (logged, counted, "degraded" until a tick succeeds) and the loop goes on.
                self.note_bug("tick", exc)
            else:
                self.clear_bug("tick")

    def _reported_profile(self, fresh: dict[str, EngineStats]) -> ModelProfile:
        """The one profile every reporting engine names, resolved; else the default (logged either way)."""
        names = {s.profile for s in fresh.values() if s.profile}
        if len(names) == 1:
            (name,) = names
            try:
                profile = resolve_profile(name)
            except ValueError as exc:
                self.log.warning("engine_profile_unusable", profile=name, error=str(exc))
            else:
                self.log.info("engine_profile", profile=profile.name, engines=len(fresh))
                return profile
        elif names:
            self.log.warning("engine_profiles_differ", profiles=sorted(names), using=self.profile.name)
        return self.profile

    async def tick(self) -> list[RoleSwitchCommand]:
        """One decision: view → policy → commands → plan. Returns the commands sent (tests, logs)."""
        now = self.clock.now_s()
        for engine in self.coord.expire(now):
            self.log.warning("ack_timeout", engine=engine, note="not retried; the next stats decide")
        fresh = self.coord.fresh_engines(now)
        if not fresh:
            return []
        if self.policy is None:
            if self._profile_auto:
                self.profile = self._reported_profile(fresh)
            try:
                self.policy = make_policy(
                    self.policy_spec, self.n_engines or len(fresh), profile=self.profile
                )
            except PolicyError as exc:  # e.g. static:P:D for another fleet size: decide nothing, say so
                self.counters["policy_errors"] += 1
                self.status = "degraded"
                self.log.error("policy_error", policy=self.policy_spec, engines=len(fresh), error=str(exc))
                return []
            self.status = "ok"
        view = build_view(
            now,
            fresh,
            {e: o.role for e, o in self.coord.outstanding.items()},
            {e: role for e, (_, role) in self.coord.applied.items()},
            await self._queue_depth(),
            self.recent.take(now),
            forecast=self._fresh_forecast(now),
        )
        self.last_view = view
        planned, reason, startup = self._target(view, now)
        commands: list[RoleSwitchCommand] = []
        # A kept plan (None) sends nothing and leaves the coordinator's last target, and a move under way, standing
        # (the simulator applies no plan then either). An acknowledged switch the stats do not show yet is the
        # coordinator's to skip (`current_roles`).
        if planned is not None:
            prefill_demand, decode_demand = role_demand(view)
            fraction = self.coord.max_concurrent_fraction
            if startup:  # idle engines only: nothing to drain, so they may all switch at once
                self.coord.max_concurrent_fraction = 1.0
            try:
                commands = self.coord.commands_for(planned, now, prefill_demand, decode_demand, reason)
            finally:
                self.coord.max_concurrent_fraction = fraction
        self._issue(commands, reason)
        await self._publish_plan(view, planned or {}, reason, now)
        return commands

    def _issue(self, commands: list[RoleSwitchCommand], reason: str) -> None:
        """Send the coordinator's commands, each as its own request (`_send`), counted and logged."""
        self.domain_metrics.on_switches(len(commands))
        for cmd in commands:
            self.counters["switches_issued"] += 1
            self.log.info("switch", engine=cmd.engine_id, role=cmd.role, epoch=cmd.epoch, reason=reason)
            self.spawn(self._send(cmd), name=f"cmd-{cmd.engine_id}")

    def _target(self, view: ClusterView, now: float) -> tuple[dict[str, str] | None, str, bool]:
        """(target roles, None if the policy keeps its plan; reason; start-up phase?) for this decision."""
        assert self.policy is not None
        if not self._initial_done:
            todo = self._startup_todo(view, now)
            if (todo or self.coord.outstanding) and now < self._initial_until_s:
                return todo, f"{self.policy.name}: initial roles", True
            self._initial_done = True
        t0 = time.perf_counter()  # wall: the decision's real compute latency
        try:
            plan = self.policy.decide(view)
        except PolicyError as exc:
            self.counters["policy_errors"] += 1
            self.log.warning("policy_error", policy=self.policy.name, error=str(exc))
            plan = None
        self.last_decision_ms = (time.perf_counter() - t0) * 1e3
        self.counters["decisions"] += 1
        self.domain_metrics.on_decision(self.last_decision_ms / 1e3)
        if plan is None:
            return None, f"{self.policy.name}: keep", False
        return dict(plan.roles), plan.reason, False

    def _startup_todo(self, view: ClusterView, now: float) -> dict[str, str]:
        """Initial roles still to apply to idle engines. An engine first seen during the start-up phase takes a role
        that keeps the counts of the policy's initial plan for the fleet seen so far (earlier choices stand)."""
        assert self.policy is not None
        ids = [e.engine_id for e in view.engines]
        if self._initial is None:
            self._initial = {}
            self._initial_until_s = now + self.initial_phase_s
        newcomers = sorted(set(ids) - set(self._initial))
        if newcomers:
            try:
                full = dict(self.policy.initial_plan(sorted(set(ids) | set(self._initial))).roles)
            except (
                PolicyError
            ) as exc:  # e.g. static:P:D built for another fleet size: engines keep their roles
                self.counters["policy_errors"] += 1
                self.log.warning("policy_error", policy=self.policy.name, error=str(exc))
                full = {}
            want = Counter(full.values())
            have = Counter(self._initial.values())
            current = view.roles()
            for e in newcomers:
                if e not in full:  # no initial role for it: it keeps its own (and is not asked again)
                    self._initial[e] = current[e]
                    continue
                role = next((r for r in ROLES if have[r] < want[r]), full[e])
                self._initial[e] = role
                have[role] += 1
        idle = {e.engine_id for e in view.engines if not (e.running or e.waiting or e.in_flight_tokens)}
        roles = view.roles()
        return {e: r for e, r in self._initial.items() if e in idle and roles.get(e) != r}

    def _fresh_forecast(self, now: float) -> DemandForecast | None:
        f = self.forecast
        if f is None or now - self._forecast_rx_s > self.forecast_stale_s:
            return None
        if not math.isfinite(f.ts_s) or abs(now - f.ts_s) > self.forecast_stale_s + self.clock_skew_s:
            return None
        return f

    async def _queue_depth(self) -> QueueDepth:
        """Prefill requests and decode handoffs held by the WORK stream (zeros if JetStream does not answer)."""
        ns = self.subjects.namespace
        try:
            assert self.js is not None
            info = await asyncio.wait_for(
                self.js.stream_info(self.subjects.work_stream, subjects_filter=f"{ns}.work.>"), timeout=1.0
            )
        except BUS_ERRORS as exc:  # the decision goes on without queue depth; engine stats still carry theirs
            self.metrics.count_error("queue_depth")
            self.log.debug("queue_depth_failed", error=repr(exc))
            return QueueDepth()
        subjects = (info.state.subjects if info.state else None) or {}
        prefill = sum(n for s, n in subjects.items() if s.startswith(f"{ns}.work.prefill."))
        decode = sum(n for s, n in subjects.items() if s.startswith(f"{ns}.work.decode."))
        return QueueDepth(prefill_messages=prefill, decode_messages=decode)

    # --- outputs ------------------------------------------------------------------------------------------------
    async def _send(self, cmd: RoleSwitchCommand) -> None:
        """Request/reply to the engine; a timeout leaves the command outstanding (no blind retry)."""
        assert self.nc is not None
        subject = self.subjects.engine_command(cmd.engine_id)
        self.metrics.count_out(subject)
        try:
            reply = await self.nc.request(subject, proto.encode(cmd), timeout=self.command_timeout_s)
        except (NatsTimeoutError, TimeoutError):
            self.counters["command_timeouts"] += 1
            self.domain_metrics.on_timeout()
            self.log.warning("command_timeout", engine=cmd.engine_id, epoch=cmd.epoch, note="not retried")
            return
        except NoRespondersError:
            self.counters["no_responders"] += 1
            self.log.warning(
                "command_no_responders", engine=cmd.engine_id, epoch=cmd.epoch, note="not retried"
            )
            return
        try:
            ack = proto.decode_as(reply.data, RoleSwitchAck, subject)
        except ProtoError as err:
            self.counters["bad_acks"] += 1
            self.metrics.count_error(err.kind)
            self.log.warning("bad_ack", engine=cmd.engine_id, error=str(err))
            return
        if ack.engine_id != cmd.engine_id:
            self.counters["bad_acks"] += 1
            self.log.warning("bad_ack", engine=cmd.engine_id, error=f"ack names {ack.engine_id}")
            return
        if not ack.ok:
            self.log.warning("switch_refused", engine=ack.engine_id, epoch=ack.epoch, error=ack.error)
        self._apply_ack(ack)

    async def _publish_plan(self, view: ClusterView, target: dict[str, str], reason: str, now: float) -> None:
        roles = {e: target.get(e, r) for e, r in view.roles().items()}
        plan = AllocationPlan(
            epoch=self.coord.epoch,
            policy=self.policy.name if self.policy is not None else self.policy_spec,
            roles=roles,  # type: ignore[arg-type]
            ts_s=now,
            reason=reason,
            forecast_ts_s=view.forecast.ts_s if isinstance(view.forecast, DemandForecast) else 0.0,
        )
        with contextlib.suppress(*BUS_ERRORS):  # a publish failure (reconnecting) must not stop the decisions
            await self.publish(self.subjects.plan, plan)
            self.counters["plans_published"] += 1
        self.domain_metrics.on_plan(plan)

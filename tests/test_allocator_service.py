"""The allocator service against a real nats-server, with tiny engines on the bus that speak the protocol: they
publish EngineStats and answer RoleSwitchCommands with RoleSwitchAcks (or, on purpose, do not answer)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import nats
import pytest

import proto
from proto import (
    AllocationPlan,
    DemandForecast,
    EngineStats,
    HealthReply,
    HealthRequest,
    HorizonForecast,
    Quantiles,
    RequestFinished,
    RoleSwitchAck,
    RoleSwitchCommand,
    Subjects,
    TurnSubmitted,
)
from services.allocator.observed import QueueDepth, RecentLoad, RecentWindow, build_view
from services.allocator.policies.prorsa import ProrsaPolicy
from services.allocator.policies.turn_model import TurnShape
from services.allocator.policy import AllocatorPolicy, ClusterView, Plan
from services.allocator.service import AllocatorService
from services.runtime.nats_server import EmbeddedNatsServer
from tests.outlook_support import outlook_forecast

SUBJECTS = Subjects()
KV_CAPACITY = 1_000_000


class TinyEngine:
    """A protocol-speaking engine without a model: stats every 0.1 s, acks commands (unless `answer` is False)."""

    def __init__(self, nc: nats.NATS, engine_id: str, role: str = "mixed", answer: bool = True) -> None:
        self.nc, self.engine_id, self.role, self.answer = nc, engine_id, role, answer
        self.epoch = 0
        self.kv_used_tokens = 0
        self.in_flight_tokens = (
            0  # > 0: it holds work (a switch then counts against the coordinator's budget)
        )
        self.stamp_offset_s = 0.0  # < 0: publish stats stamped in the past (a replay / a lagging clock)
        self.publishing = True
        self.profile = ""  # the performance profile it reports
        self.commands: list[RoleSwitchCommand] = []
        self.switch_s = 0.0  # how long a switch takes before the ack (the engine acks once it is done)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.nc.subscribe(SUBJECTS.engine_command(self.engine_id), cb=self._on_command)
        self._task = asyncio.create_task(self._stats_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _on_command(self, msg) -> None:
        cmd = proto.decode_as(msg.data, RoleSwitchCommand)
        self.commands.append(cmd)
        if not self.answer:
            return
        await asyncio.sleep(self.switch_s)
        if cmd.epoch > self.epoch:  # an older or repeated epoch is answered, never applied again
            self.role, self.epoch = cmd.role, cmd.epoch
        ack = RoleSwitchAck(
            engine_id=self.engine_id, epoch=self.epoch, role=self.role, ok=True, ts_s=time.time()
        )
        await msg.respond(proto.encode(ack))
        await self.nc.publish(SUBJECTS.engine_ack(self.engine_id), proto.encode(ack))

    async def _stats_loop(self) -> None:
        while True:
            if self.publishing:
                stats = EngineStats(
                    engine_id=self.engine_id,
                    ts_s=time.time() + self.stamp_offset_s,
                    role=self.role,
                    epoch=self.epoch,
                    kv_used_tokens=self.kv_used_tokens,
                    kv_capacity_tokens=KV_CAPACITY,
                    in_flight_tokens=self.in_flight_tokens,
                    profile=self.profile,
                )
                await self.nc.publish(SUBJECTS.engine_stats(self.engine_id), proto.encode(stats))
            await asyncio.sleep(0.1)


class PlanWatcher:
    def __init__(self) -> None:
        self.plans: list[AllocationPlan] = []

    async def cb(self, msg) -> None:
        self.plans.append(proto.decode_as(msg.data, AllocationPlan))


@pytest.fixture
async def bus(nats_server: EmbeddedNatsServer) -> AsyncIterator[tuple[str, nats.NATS, PlanWatcher]]:
    conn = await nats.connect(nats_server.url)
    watcher = PlanWatcher()
    await conn.subscribe(SUBJECTS.plan, cb=watcher.cb)
    yield nats_server.url, conn, watcher
    await conn.close()


async def fleet(nc: nats.NATS, roles: dict[str, str], silent: tuple[str, ...] = ()) -> dict[str, TinyEngine]:
    engines = {e: TinyEngine(nc, e, r, answer=e not in silent) for e, r in roles.items()}
    for eng in engines.values():
        await eng.start()
    return engines


def allocator(url: str, policy: str = "prorsa", **kw) -> AllocatorService:
    defaults = dict(
        interval_s=0.2, stale_after_s=1.0, command_timeout_s=0.5, ack_timeout_s=30.0, profile="qwen3-235b"
    )
    return AllocatorService(url, policy=policy, **{**defaults, **kw})


@pytest.mark.parametrize(("reported", "planned"), [("cpu-tiny", "cpu-tiny"), ("", "qwen3-235b")])
async def test_the_allocator_plans_with_the_profile_its_engines_report(
    bus, reported: str, planned: str
) -> None:
    url, nc, _ = bus
    engines = await fleet(nc, {"e0": "mixed", "e1": "mixed"})
    for e in engines.values():
        e.profile = reported
    svc = allocator(url, profile="auto")
    await svc.start()
    try:
        await until(lambda: svc.policy is not None)
        assert svc.policy.capacity.profile.name == planned  # type: ignore[attr-defined]
    finally:
        await stop_all(svc, engines)


async def until(cond: Callable[[], bool], timeout_s: float = 5.0, what: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in time: {what()}")
        await asyncio.sleep(0.05)


async def stop_all(svc: AllocatorService, engines: dict[str, TinyEngine]) -> None:
    await svc.stop()
    for eng in engines.values():
        await eng.stop()


async def test_initial_roles_then_a_decision_with_increasing_epochs_and_one_command_per_ack(bus) -> None:
    url, nc, watcher = bus
    engines = await fleet(nc, {f"e{i}": "mixed" for i in range(4)})
    svc = allocator(url, policy="reactive:cooldown_s=100")
    await svc.start()
    try:
        # Start-up: the policy's initial roles, 2 prefill + 2 decode, applied to the idle engines.
        await until(
            lambda: sorted(e.role for e in engines.values()) == ["decode", "decode", "prefill", "prefill"]
        )
        await asyncio.sleep(0.6)  # several more decisions: nothing is re-sent once acknowledged
        assert all(len(e.commands) == 1 for e in engines.values())
        epochs = sorted(c.epoch for e in engines.values() for c in e.commands)
        assert epochs == [1, 2, 3, 4]
        # Then the policy decides: decode engines run out of KV, reactive moves one prefill engine to decode.
        for e in engines.values():
            if e.role == "decode":
                e.kv_used_tokens = int(0.95 * KV_CAPACITY)
        await until(lambda: sum(e.role == "decode" for e in engines.values()) == 3)
        newest = max((c for e in engines.values() for c in e.commands), key=lambda c: c.epoch)
        assert newest.epoch == 5 and newest.role == "decode"
        assert svc.counters["switches_issued"] == 5 and svc.coord.outstanding == {}
        await until(lambda: watcher.plans and sorted(watcher.plans[-1].roles.values()).count("decode") == 3)
        last = watcher.plans[-1]
        assert last.policy == "reactive" and last.epoch == 5 and set(last.roles) == set(engines)
    finally:
        await stop_all(svc, engines)


async def test_a_staged_move_goes_on_as_acks_arrive_not_a_decision_later(bus) -> None:
    """Eight busy engines, a quarter switching at a time: each ack sends the next command
    (`SwitchCoordinator.follow_up`), so the whole move lands within the first decision's interval."""
    url, nc, _ = bus
    engines = await fleet(nc, {f"e{i}": "mixed" for i in range(8)})
    for e in engines.values():
        e.in_flight_tokens = 1_000
    svc = allocator(url, policy="static:5:3", interval_s=2.0)
    await svc.start()
    try:
        await until(lambda: any(e.commands for e in engines.values()), timeout_s=5.0)
        await until(lambda: sorted(e.role for e in engines.values()).count("prefill") == 5, timeout_s=1.5)
        assert sorted(e.role for e in engines.values()).count("decode") == 3
        assert svc.counters["decisions"] == 1  # the move went on between decisions
        epochs = sorted(c.epoch for e in engines.values() for c in e.commands)
        assert epochs == list(range(1, 9))  # each engine commanded once
    finally:
        await stop_all(svc, engines)


class MoveOnce(AllocatorPolicy):
    """Decides one move (to 5:3) at its first decision and keeps from then on."""

    def initial_plan(self, engine_ids):
        return Plan(roles=dict.fromkeys(engine_ids, "mixed"), reason="mixed")

    def plan(self, view: ClusterView) -> Plan | None:
        if getattr(self, "moved", False):
            return None
        self.moved = True
        ids = sorted(e.engine_id for e in view.engines)
        return Plan(
            roles={e: "prefill" if i < 5 else "decode" for i, e in enumerate(ids)}, reason="move once"
        )


async def test_a_kept_plan_leaves_a_staged_move_going(bus) -> None:
    """Decisions that keep (the policy returns None) while a staged move is under way do not cancel it: the acks
    carry it through, as in the simulator, which applies no plan on a keep."""
    url, nc, _ = bus
    engines = await fleet(nc, {f"e{i}": "mixed" for i in range(8)})
    for e in engines.values():
        e.in_flight_tokens, e.switch_s = 1_000, 0.3
    svc = allocator(url, interval_s=0.2)
    svc.policy = MoveOnce(name="move-once", interval_s=0.2)
    await svc.start()
    try:
        await until(lambda: sorted(e.role for e in engines.values()) == ["decode"] * 3 + ["prefill"] * 5)
        assert svc.counters["decisions"] > 3  # several keeps went by during the move
        assert all(len(e.commands) == 1 for e in engines.values())
    finally:
        await stop_all(svc, engines)


async def test_engines_joining_during_start_up_keep_the_initial_split(bus) -> None:
    url, nc, _ = bus
    engines = await fleet(nc, {"e0": "mixed", "e1": "mixed"})
    svc = allocator(url, policy="prorsa:initial=split:prefill_fraction=0.5")
    await svc.start()
    try:
        await until(lambda: sorted(e.role for e in engines.values()) == ["decode", "prefill"])
        engines.update(await fleet(nc, {"e2": "mixed", "e3": "mixed"}))
        await until(
            lambda: sorted(e.role for e in engines.values()) == ["decode", "decode", "prefill", "prefill"]
        )
        assert all(len(e.commands) == 1 for e in engines.values())
    finally:
        await stop_all(svc, engines)


async def test_a_command_that_times_out_is_not_retried(bus) -> None:
    url, nc, _ = bus
    engines = await fleet(nc, {"e0": "mixed", "e1": "mixed", "e2": "mixed"}, silent=("e0",))
    svc = allocator(url, policy="prorsa:initial=split", command_timeout_s=0.3, ack_timeout_s=30.0)
    await svc.start()
    try:
        await until(lambda: svc.counters["command_timeouts"] == 1)
        await asyncio.sleep(0.8)  # four more decisions
        assert len(engines["e0"].commands) == 1  # never re-sent while its ack is missing
        assert engines["e0"].role == "mixed" and "e0" in svc.coord.outstanding
        assert svc.counters["command_timeouts"] == 1
        assert [len(engines[e].commands) for e in ("e1", "e2")] == [1, 1]
    finally:
        await stop_all(svc, engines)


async def test_stale_stats_are_never_acted_on(bus) -> None:
    url, nc, watcher = bus
    engines = await fleet(nc, {"live0": "mixed", "live1": "mixed", "old": "mixed", "gone": "mixed"})
    engines["old"].stamp_offset_s = -60.0  # reports stamped a minute ago: a replay or a lagging clock
    engines["gone"].publishing = False
    svc = allocator(url, policy="prorsa", stale_after_s=1.0)
    await svc.start()
    try:
        await until(lambda: len(watcher.plans) >= 3)
        assert {e for p in watcher.plans for e in p.roles} == {"live0", "live1"}
        assert engines["old"].commands == [] and engines["gone"].commands == []
        assert svc.counters["stale_stats"] > 0
        # An engine that goes quiet drops out of the plans once its last stats are older than the bound.
        engines["live1"].publishing = False
        quiet_since = time.time()
        await until(lambda: set(watcher.plans[-1].roles) == {"live0"})
        assert time.time() - quiet_since >= 1.0 - 0.15  # not before its last stats passed the bound
    finally:
        await stop_all(svc, engines)


async def test_forecasts_and_request_events_reach_the_policy_view(bus) -> None:
    url, nc, _ = bus
    engines = await fleet(nc, {"e0": "prefill", "e1": "decode"})
    svc = allocator(url, policy="prorsa", forecast_stale_s=5.0)
    await svc.start()
    try:
        q = Quantiles(q10=1.0, q50=2.0, q90=3.0)
        horizon = HorizonForecast(
            horizon_s=10.0, prefill_tokens=q, decode_tokens=q, decode_concurrency=q, kv_tokens=q
        )
        fresh = DemandForecast(ts_s=time.time(), predictor="test", horizons=[horizon])
        await nc.publish(SUBJECTS.forecast, proto.encode(fresh))
        await until(lambda: svc.last_view is not None and svc.last_view.forecast == fresh)
        windows = []  # every request-level window the service takes, in order
        take = svc.recent.take

        def recording_take(now: float) -> RecentWindow:
            windows.append(take(now))
            return windows[-1]

        svc.recent.take = recording_take  # type: ignore[method-assign]
        turn = TurnSubmitted(
            traj_id="t1", ts_s=time.time(), turn=0, request_id="t1:0", prompt_tokens=900, new_tokens=300
        )
        done = RequestFinished(
            engine_id="e1",
            ts_s=time.time(),
            request_id="t1:0",
            traj_id="t1",
            turn=0,
            prompt_tokens=900,
            cached_tokens=600,
            output_tokens=77,
        )
        await nc.publish(SUBJECTS.lifecycle, proto.encode(turn))
        await nc.publish(SUBJECTS.engine_events("e1"), proto.encode(done))
        # The two events may land in different decision windows.
        await until(
            lambda: any(w.requests for w in windows) and any(w.mean_osl_tokens for w in windows),
            what=lambda: f"windows {windows}, errors {svc.metrics.error_counts}",
        )
        arrived = next(w for w in windows if w.requests)
        assert (arrived.requests, arrived.mean_isl_tokens, arrived.mean_cached_tokens) == (1, 300.0, 600.0)
        assert next(w for w in windows if w.mean_osl_tokens).mean_osl_tokens == 77.0
        stale = DemandForecast(ts_s=time.time() - 60.0, predictor="test", horizons=[horizon])
        await nc.publish(SUBJECTS.forecast, proto.encode(stale))
        await until(lambda: svc.last_view is not None and svc.last_view.forecast is None)
    finally:
        await stop_all(svc, engines)


async def test_the_policy_decides_from_the_outlook_of_a_forecast_on_the_bus(bus) -> None:
    """Demand reaches the allocator one way: a forecast whose outlook holds 64 live trajectories (all new: a step
    starts), tool calls of 3 s and 30k-token contexts ahead. The service subscribes to no tracker snapshot; the
    prorsa policy takes N, the turn and the step's mix from the outlook and scores the splits for them."""
    url, nc, _ = bus
    engines = await fleet(nc, {"e0": "prefill", "e1": "decode"})
    svc = allocator(url, policy="prorsa", forecast_stale_s=5.0, profile="deepseek-v3.2")
    await svc.start()
    try:
        assert SUBJECTS.snapshot not in svc.consumed
        await until(lambda: svc.policy is not None and svc.counters["decisions"] > 0)
        assert svc.policy.last_scores == {}  # type: ignore[union-attr]  # no demand yet: nothing to score
        shape = TurnShape(new_tokens=2_000, output_tokens=200, context_tokens=30_000, tool_s=3.0)
        fc = outlook_forecast({"general": 64}, shape, started_total=64, now=time.time(), finished_per_s=0.2)
        await nc.publish(SUBJECTS.forecast, proto.encode(fc))
        policy = svc.policy
        assert isinstance(policy, ProrsaPolicy)
        await until(lambda: bool(policy.last_scores), what=lambda: f"view {svc.last_view}")
        assert svc.last_view is not None and svc.last_view.forecast == fc
        assert policy.last_shape is not None and policy.last_shape.tool_s == 3.0
        assert policy.last_shape.context_tokens == 30_000
        assert policy.memory.expected_next() == ("general",) and policy._finish_rate > 0
    finally:
        await stop_all(svc, engines)


HOSTILE = [
    b"",
    b"\x00\xff not json",
    b"[]",
    b'{"type": "engine_stats"}',
    b'{"type": "engine_stats", "schema_version": 99, "engine_id": "x", "ts_s": 1, "role": "prefill", "epoch": 0}',
    b'{"type": "health_request", "schema_version": 2}',
    b'{"type": "engine_stats", "schema_version": 2, "engine_id": "e0", "ts_s": 1e300, "role": "decode", "epoch": 0}',
    b'{"type": "engine_stats", "schema_version": 2, "engine_id": "zz", "ts_s": 1, "role": "decode", "epoch": -1}',
    b'{"type": "role_switch_ack", "schema_version": 2, "engine_id": "e0", "epoch": 1e40, "role": "decode", "ok": 1}',
    b'{"type": "demand_forecast", "schema_version": 2, "ts_s": 0, "predictor": "x", "horizons": [{"horizon_s": -1}]}',
    b"{" * 10_000,
]


async def test_hostile_payloads_on_every_consumed_subject_do_not_crash_it(bus) -> None:
    url, nc, watcher = bus
    engines = await fleet(nc, {"e0": "mixed", "e1": "mixed"})
    svc = allocator(url, policy="prorsa:initial=split:prefill_fraction=0.5")
    await svc.start()
    try:
        await until(lambda: len(watcher.plans) >= 2)
        for pattern in svc.consumed:
            subject = pattern.replace("*", "e0")
            for payload in HOSTILE:
                await nc.publish(subject, payload)
        # Future-stamped stats for a real engine: rejected, or they would hide every later report of it.
        future = EngineStats(engine_id="e0", ts_s=time.time() + 3600, role="decode", epoch=0)
        await nc.publish(SUBJECTS.engine_stats("e0"), proto.encode(future))
        # Stats on another engine's subject: rejected.
        await nc.publish(
            SUBJECTS.engine_stats("e1"),
            proto.encode(EngineStats(engine_id="e0", ts_s=time.time(), role="decode", epoch=0)),
        )
        await nc.flush()
        n = len(watcher.plans)
        await until(lambda: len(watcher.plans) >= n + 3)  # still deciding
        assert set(watcher.plans[-1].roles) == {"e0", "e1"}
        assert svc.coord.stats["e0"].ts_s < time.time() + 10  # the future stamp did not stick
        assert sum(svc.metrics.error_counts.values()) >= len(HOSTILE)
        assert (
            svc.metrics.error_counts.get("tick", 0) == 0 and svc.metrics.error_counts.get("handler", 0) == 0
        )
        reply = await nc.request(SUBJECTS.health, proto.encode(HealthRequest()), timeout=2)
        health = proto.decode_as(reply.data, HealthReply)
        assert health.status == "ok" and health.details["policy"] == "prorsa"
        assert health.details["engines_seen"] == 2 and health.details["epoch"] == svc.coord.epoch
        assert health.details["switches_issued"] == svc.counters["switches_issued"]
    finally:
        await stop_all(svc, engines)


async def test_a_bug_in_a_decision_is_surfaced_and_the_loop_decides_on(bus) -> None:
    url, nc, watcher = bus
    engines = await fleet(nc, {"e0": "mixed", "e1": "mixed"})
    svc = allocator(url)
    real_tick = svc.tick
    seen: list[str] = []  # the health status at the start of each tick

    async def buggy_tick() -> list[RoleSwitchCommand]:
        seen.append(svc.health_status)
        if len(seen) <= 2:
            raise KeyError("our bug")
        return await real_tick()

    svc.tick = buggy_tick  # type: ignore[method-assign]
    await svc.start()
    try:
        await until(lambda: len(watcher.plans) >= 1)  # the loop went on
        assert svc.metrics.error_counts.get("tick") == 2
        assert seen[:3] == ["ok", "degraded", "degraded"]  # surfaced until a tick succeeds
        assert svc.health_status == "ok" and not svc.bugs
    finally:
        await stop_all(svc, engines)


async def test_a_policy_that_does_not_fit_the_fleet_degrades_without_commands(bus) -> None:
    url, nc, watcher = bus
    engines = await fleet(nc, {"e0": "mixed", "e1": "mixed"})
    svc = allocator(url, policy="static:3:5")  # built for 8 engines, 2 are here
    await svc.start()
    try:
        await until(lambda: svc.counters["policy_errors"] >= 2)
        assert svc.status == "degraded" and watcher.plans == []
        assert all(e.commands == [] for e in engines.values())
        forged = RoleSwitchAck(engine_id="e0", epoch=10**12, role="prefill", ok=True)
        await nc.publish(SUBJECTS.engine_ack("e0"), proto.encode(forged))
        await until(lambda: svc.counters["bad_acks"] == 1)
        assert svc.coord.epoch == 0  # a forged epoch does not move ours
    finally:
        await stop_all(svc, engines)


async def test_unknown_policy_or_profile_fails_at_construction() -> None:
    from services.allocator.policy import PolicyError

    with pytest.raises(PolicyError):
        AllocatorService("nats://127.0.0.1:1", policy="nope")
    with pytest.raises(ValueError):
        AllocatorService("nats://127.0.0.1:1", profile="no-such-profile")


# --- the pure pieces ---------------------------------------------------------------------------------------------


def test_recent_load_windows_and_resets() -> None:
    r = RecentLoad()
    first = r.take(10.0)
    assert first.window_s == 0.0 and first.requests == 0
    r.observe_turn(new_tokens=100, prompt_tokens=1000)
    r.observe_turn(new_tokens=300, prompt_tokens=3000)
    r.observe_finished(50)
    w = r.take(15.0)
    assert (w.window_s, w.requests, w.mean_isl_tokens, w.mean_cached_tokens, w.mean_osl_tokens) == (
        5.0,
        2,
        200.0,
        1800.0,
        50.0,
    )
    assert w.finished == 1  # the count the answer length is the mean of
    r.observe_turn(new_tokens=100, prompt_tokens=1000)
    r.observe_prefill(new_tokens=700, cached_tokens=300)  # what the engine computed wins over what was sent
    w = r.take(16.0)
    assert (w.window_s, w.mean_isl_tokens, w.mean_cached_tokens, w.mean_osl_tokens) == (
        1.0,
        700.0,
        300.0,
        0.0,
    )
    assert (w.away_prefills, w.mean_away_new_tokens) == (0, 0.0)
    # Turns sent away from their cache are counted apart: what each computed is a miss's price.
    r.observe_prefill(new_tokens=100, cached_tokens=9_900)
    r.observe_prefill(new_tokens=6_000, cached_tokens=4_000, away=True)
    r.observe_prefill(new_tokens=2_000, cached_tokens=0, away=True)
    w = r.take(17.0)
    assert (w.away_prefills, w.mean_away_new_tokens, w.mean_isl_tokens) == (2, 4_000.0, 8_100 / 3)
    assert r.take(18.0).away_prefills == 0  # and start afresh each window


def test_build_view_maps_stats_targets_and_queues() -> None:
    now = 100.0
    stats = {
        "p": EngineStats(
            engine_id="p", ts_s=now, role="prefill", epoch=3, running=2, waiting=1, in_flight_tokens=5000
        ),
        "d": EngineStats(engine_id="d", ts_s=now, role="decode", epoch=3, running=40, kv_used_tokens=80_000),
        "m": EngineStats(engine_id="m", ts_s=now, role="mixed", epoch=2, running=4, prefill_tokens_per_s=9.0),
    }
    recent = RecentLoad(started_s=95.0)
    recent.observe_prefill(1000, 0)
    recent.observe_prefill(1000, 0, away=True)
    recent.observe_finished(120)
    recent.observe_finished(80)
    view = build_view(now, stats, {"m": "decode"}, {"p": "decode"}, QueueDepth(10, 50), recent.take(now))
    assert (view.recent_away_prefills, view.recent_mean_away_new_tokens) == (1, 1000.0)
    assert (view.recent_finished, view.recent_mean_osl_tokens) == (2, 100.0)
    by_id = {e.engine_id: e for e in view.engines}
    assert (
        by_id["p"].role == "decode" and by_id["p"].queued_prefill_tokens == 0
    )  # acked switch wins over stats
    assert by_id["d"].decode_batch == 40 and by_id["d"].queued_prefill_tokens == 0
    assert (
        by_id["m"].switching and by_id["m"].target_role == "decode" and by_id["m"].prefill_tokens_per_s == 9.0
    )
    # 10 prefill messages held; the prefill engine's switch is acked (drained), the mixed engine holds 4 turns it
    # pulled: 6 × mean ISL waiting.
    assert view.prefill_queue_tokens == 6 * 1000
    assert view.decode_queue_len == 50 - 40 - 2 - 1  # the two decode engines' pulled work is not waiting
    assert view.roles() == {"d": "decode", "m": "decode", "p": "decode"}

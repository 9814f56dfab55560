"""The simulator's live forecast feed: built only for forecasting policies, never ahead of the decision's clock."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from prorsa.sim.forecast_feed import ForecastFeed, decoded_at, live_feed
from prorsa.sim.runner import SimConfig, _load_workload, run_simulation, simulate
from proto import DemandForecast, LifecycleSnapshot
from services.allocator.policy import ClusterView
from services.allocator.registry import make_policy
from services.engine_agent.engine_core import IDLE, JUMP, EngineCore
from services.runtime.model_profiles import load_profile

# Small and fast: 3 engines, 8 math trajectories; the lifecycle predictor refits in milliseconds here.
SMALL = SimConfig(
    workload="profile:math", engines=3, batch_size=8, seed=3, policy="prorsa", forecaster="lifecycle"
)


class _Counter:
    def __init__(self) -> None:
        self.events = 0

    def on_event(self, kind: str, traj_id: str, now: float, **f: Any) -> None:
        self.events += 1


class _StampedFeed(ForecastFeed):
    """Checks the no-look-ahead property: nothing the feed consumes is stamped after the decision's `now`, and
    no event reaches it later with a time before a decision it already answered."""

    def __init__(self, inner: ForecastFeed) -> None:
        self.__dict__.update(inner.__dict__)
        self.now = -1.0
        self.applied = 0
        self.decided: list[float] = []

    def on_event(self, kind: str, traj_id: str, now: float, **f: Any) -> None:
        assert not self.decided or now >= self.decided[-1], (kind, now, self.decided[-1])
        super().on_event(kind, traj_id, now, **f)

    def at(self, now: float, engines):  # type: ignore[no-untyped-def]
        assert self.last_event_s <= now
        self.now = now
        out = super().at(now, engines)
        self.decided.append(now)
        return out

    def _apply(self, msg: Any, t: float) -> None:
        assert t <= self.now and msg.ts_s <= self.now, (type(msg).__name__, t, self.now)
        self.applied += 1
        super()._apply(msg, t)


def test_the_feed_never_sees_an_event_after_now() -> None:
    profile = load_profile(SMALL.profile)
    policy = make_policy(SMALL.policy, SMALL.engines, profile=profile)
    workload, feed = live_feed(SMALL, _load_workload(SMALL))
    stamped = _StampedFeed(feed)
    result = simulate(SMALL, policy, profile, workload, feed=stamped)
    assert len(stamped.decided) > 10 and stamped.applied > 100
    assert result.sim.metrics.trajectories_completed == SMALL.batch_size
    assert stamped.bad_rejections == {}  # the tracker accepted the synthesized stream as a live one
    assert stamped.tracker.totals["finished"] == SMALL.batch_size
    # Every token reaches the forecaster's series once, in the window it was made in: the windows closed by the
    # last decision hold the decode tokens made by then (no loss, no double count), spread over many windows
    # rather than lumped into the windows of decisions.
    series = list(stamped.core.series)
    last_s = series[-1].end_s
    decoded = sum(p.decode_tokens for p in series)
    made = stamped.tracker.decode_tokens_total
    assert decoded <= result.sim.metrics.decoded_tokens and decoded >= 0.9 * made
    busy = [p.decode_tokens for p in series if p.decode_tokens > 0]
    assert len(busy) > 0.5 * last_s  # most seconds of the run saw some decode
    # Deterministic and unchanged by the checks: same run as the plain entry point.
    assert result.to_json() == run_simulation(SMALL).to_json()


def test_prorsa_views_carry_a_forecast_whose_outlook_is_the_snapshot_of_now() -> None:
    """The policy's view holds the forecast alone; its outlook counts the live trajectories the tracker's snapshot
    (the forecaster's input, never the policy's) held at the decision, phase by phase."""
    profile = load_profile(SMALL.profile)
    policy = make_policy("prorsa", SMALL.engines, profile=profile)
    recorded, feed = live_feed(SMALL, _load_workload(SMALL))
    snapshots: dict[int, LifecycleSnapshot] = {}  # id(forecast) -> the snapshot it was made from
    at = feed.at

    def spy_at(now: float, engines):  # type: ignore[no-untyped-def]
        fc = at(now, engines)
        assert feed.last_snapshot is not None
        snapshots[id(fc)] = feed.last_snapshot
        return fc

    feed.at = spy_at  # type: ignore[method-assign]
    views: list[ClusterView] = []
    plan = policy.plan

    def spy(view: ClusterView):  # type: ignore[no-untyped-def]
        views.append(view)
        return plan(view)

    policy.plan = spy  # type: ignore[method-assign]
    simulate(SMALL, policy, profile, recorded, feed=feed)
    assert len(views) > 10
    assert not hasattr(views[0], "snapshot")
    for v in views:
        fc = v.forecast
        assert isinstance(fc, DemandForecast) and fc.ts_s == v.now
        snap = snapshots[id(fc)]
        assert snap.ts_s == v.now and fc.started_total == snap.started_total
        assert [h.horizon_s for h in fc.horizons] == [5.0, 10.0, 30.0] and fc.outlook_horizon_s == 5.0
        for phase in ("queued", "prefill", "decode", "tool_call"):
            assert sum(getattr(t, phase) for t in fc.outlook) == snap.counts.get(phase, 0)
        assert {t.task for t in fc.outlook} == {k for k, c in snap.counts_by_task.items() if sum(c.values())}
    # Once trajectories run, the forecaster sees decode demand ahead, and turns and their contexts.
    assert any(h.decode_tokens.q50 > 0 for v in views for h in v.forecast.horizons)
    assert any(t.decode > 0 and t.context_tokens.observed > 0 for v in views for t in v.forecast.outlook)


def test_policies_without_forecasts_build_no_feed_and_keep_the_users_observer() -> None:
    for spec in ("colocated", "static:1:2", "reactive", "dynamo"):
        result = run_simulation(dataclasses.replace(SMALL, policy=spec))
        assert result.sim.feed is None and result.sim.observer is None  # no event is even emitted
    user = _Counter()
    result = run_simulation(dataclasses.replace(SMALL, policy="colocated", observer=user))
    assert result.sim.observer is user and user.events > 0


def test_the_feed_tees_with_a_users_observer_without_changing_the_run() -> None:
    user = _Counter()
    watched = run_simulation(dataclasses.replace(SMALL, observer=user))
    assert isinstance(watched.sim.feed, ForecastFeed) and user.events > 100
    assert watched.to_json() == run_simulation(SMALL).to_json()


def test_the_forecaster_is_configurable_and_checked() -> None:
    assert SMALL.echo()["forecaster"] == "lifecycle"
    with pytest.raises(ValueError, match="unknown predictor"):
        run_simulation(dataclasses.replace(SMALL, forecaster="crystal-ball"))
    with pytest.raises(ValueError):
        SimConfig(forecaster="")


def _jump_engine(steps_done: int, t_start: float, a: float, b: float, steps: int) -> EngineCore:
    """An engine core in the middle of a decode jump with the given bookkeeping."""
    engine = EngineCore(load_profile("qwen3-235b"), "decode")
    engine.activity, engine.steps_done, engine._t_start = JUMP, steps_done, t_start
    engine._jump_a, engine._jump_b, engine._jump_steps = a, b, steps
    return engine


@pytest.mark.parametrize(
    ("a", "b", "now", "expected"),
    [
        (0.1, 0.0, 10.0, 6),  # jump start: the token its prefill sampled and the 5 steps since it joined
        (0.1, 0.0, 10.05, 6),  # mid-step: that step is not out yet
        (0.1, 0.0, 10.1, 7),  # first step ends at 10.1
        (0.1, 0.0, 10.35, 9),
        (0.1, 0.0, 11.0, 16),  # the jump's 10 steps are done
        (0.1, 0.0, 99.0, 16),  # never past the jump
        (0.1, 0.01, 10.1, 7),  # growing step time: step k ends at k·a + b·k(k−1)/2
        (0.1, 0.01, 10.2, 7),  # 2 steps need 0.21 s
        (0.1, 0.01, 10.21, 8),
        (0.1, 0.01, 11.45, 16),  # 10 steps: 1.0 + 0.45
    ],
)
def test_decoded_at_counts_the_steps_of_the_jump_done_by_now(
    a: float, b: float, now: float, expected: int
) -> None:
    engine = _jump_engine(steps_done=25, t_start=10.0, a=a, b=b, steps=10)
    req = SimpleNamespace(start_step=20, target_step=35)
    assert decoded_at(engine, req, now) == expected  # type: ignore[arg-type]


def test_decoded_at_outside_a_jump_is_the_step_counter() -> None:
    engine = _jump_engine(steps_done=25, t_start=10.0, a=0.1, b=0.0, steps=10)
    engine.activity = IDLE
    assert decoded_at(engine, SimpleNamespace(start_step=20, target_step=35), 50.0) == 6  # type: ignore[arg-type]

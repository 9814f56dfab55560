"""The prorsa policy reads demand one way, the forecast's outlook (services/allocator/policies/outlook.py): N, the
tool call and the context of the turns ahead, the finish rate behind H, and the task mix of a step start — and
falls back as it did before there was one."""

from __future__ import annotations

import msgspec
import pytest

from proto import DemandForecast, Estimate, TaskOutlook
from services.allocator.policies.outlook import outlook_of
from services.allocator.policies.prorsa import DEFAULT_TOOL_S, ProrsaPolicy
from services.allocator.policies.turn_model import TurnShape
from services.allocator.policy import ClusterView, EngineView
from services.allocator.registry import make_policy
from tests.outlook_support import exact, outlook_forecast

SHAPE = TurnShape(new_tokens=2_000, output_tokens=200, context_tokens=30_000, tool_s=3.0)


def view(forecast: object | None, now: float = 5.0, running: int = 6) -> ClusterView:
    """Eight colocated engines, `running` requests on each, a window of 20 turns of 2,000 new tokens (isl 2,200
    with the recomputed answer: a 12,000-token prompt in all) and 200 output tokens."""
    engines = tuple(
        EngineView(
            engine_id=f"e{i}",
            role="mixed",
            running=running,
            waiting=0,
            queued_prefill_tokens=0,
            decode_batch=running,
            kv_used_tokens=running * 10_000,
            kv_capacity_tokens=3_000_000,
            in_flight_tokens=0,
            switching=False,
        )
        for i in range(8)
    )
    return ClusterView(
        now=now,
        engines=engines,
        prefill_queue_tokens=0,
        decode_queue_len=0,
        prefill_tokens_per_s=8_000.0,
        decode_tokens_per_s=800.0,
        forecast=forecast,
        recent_window_s=5.0,
        recent_requests=20,
        recent_mean_isl_tokens=2_200.0,
        recent_mean_cached_tokens=9_800.0,
        recent_mean_osl_tokens=200.0,
        recent_mean_new_tokens=2_000.0,
    )


def policy() -> ProrsaPolicy:
    p = make_policy("prorsa", 8, profile="deepseek-v3.2")
    assert isinstance(p, ProrsaPolicy)
    return p


def test_n_the_turn_h_and_the_mix_come_from_the_outlook() -> None:
    fc = outlook_forecast({"general": 60, "math": 40}, SHAPE, started_total=100, finished_per_s=0.25)
    p = policy()
    p.decide(view(fc))
    o = outlook_of(view(fc))
    assert o is not None and (o.live, o.started_total) == (100, 100)
    assert p.live_trajectories(view(fc), o, SHAPE) == 100.0  # not the 48 requests the engines hold
    shape = p.last_shape
    assert shape is not None
    assert (shape.tool_s, shape.context_tokens) == (
        3.0,
        30_000,
    )  # the outlook's, not Little's or the window's
    assert (shape.new_tokens, shape.output_tokens) == (2_000, 200)  # the window's (prorsa.shape says why)
    # Both tasks finish 0.25 a second: 0.5 in all, folded in with half weight at the first decision; the same
    # decision time folds nothing more. H = N / (2 phi).
    assert p._finish_rate == pytest.approx(0.25)
    assert p.horizon_s(view(fc), o, 100.0) == pytest.approx(100.0 / (2 * 0.25))
    # The step's start: all 100 live are new since the last decision, of two tasks over 10 % each.
    assert p.memory.recording and p.memory.expected_next() == ("general", "math")


def test_tasks_weigh_in_by_the_turns_they_submit() -> None:
    def task(name: str, live: int, turns: float, context: float, observed: int = 10) -> TaskOutlook:
        return TaskOutlook(
            task=name,
            decode=live,
            turns=exact(turns),
            context_tokens=exact(context, observed),
            tool_s=exact(2.0 if name == "general" else 0.5, observed),
        )

    fc = DemandForecast(
        ts_s=0.0,
        predictor="test",
        horizons=[],
        outlook=[task("general", 50, 10.0, 30_000), task("math", 50, 30.0, 6_000)],
        outlook_horizon_s=5.0,
    )
    o = outlook_of(view(fc))
    assert o is not None
    assert o.context_tokens == pytest.approx((10 * 30_000 + 30 * 6_000) / 40)
    assert o.tool_s == pytest.approx((10 * 2.0 + 30 * 0.5) / 40)
    assert o.live_by_task == {"general": 50, "math": 50}
    # a task whose figure rests on nothing observed does not weigh in
    fc = msgspec.structs.replace(
        fc, outlook=[task("general", 50, 10.0, 30_000), task("math", 50, 30.0, 6_000, 0)]
    )
    o = outlook_of(view(fc))
    assert o is not None and o.context_tokens == 30_000 and o.tool_s == 2.0


def test_without_an_outlook_the_policy_falls_back_as_before() -> None:
    """No forecast yet, or one from a forecaster that sends no outlook (`outlook_horizon_s` 0): N is what the
    engines hold plus those in a tool call by Little's law, the tool call a default, the context the window's
    prompts, H the longest, and no step start is seen."""
    older = DemandForecast(ts_s=0.0, predictor="older", horizons=[])
    for fc in (None, older):
        p = policy()
        v = view(fc)
        assert outlook_of(v) is None
        p.decide(v)
        shape = p.last_shape
        assert shape is not None
        assert (shape.tool_s, shape.context_tokens) == (DEFAULT_TOOL_S, 2_200 + 9_800)
        assert p.live_trajectories(v, None, shape) == pytest.approx(48 + 20 / 5.0 * DEFAULT_TOOL_S)
        assert p.horizon_s(v, None, 52.0) == p.max_horizon_s
        assert not p.memory.recording and p.memory.expected_next() is None


def test_figures_the_outlook_has_not_observed_keep_the_defaults() -> None:
    """A forecaster before its first observations publishes priors (`observed` 0): the population counts, its
    per-turn figures do not."""
    prior = Estimate(mean=9.0, q10=9.0, q50=9.0, q90=9.0)
    fc = outlook_forecast({"general": 64})
    fc = msgspec.structs.replace(
        fc, outlook=[msgspec.structs.replace(fc.outlook[0], tool_s=prior, context_tokens=prior)]
    )
    p = policy()
    p.decide(view(fc))
    shape = p.last_shape
    assert shape is not None and (shape.tool_s, shape.context_tokens) == (DEFAULT_TOOL_S, 12_000)
    assert p.live_trajectories(view(fc), outlook_of(view(fc)), shape) == 64.0

"""The demand outlook each forecaster publishes (services/forecaster/outlook.py, lifecycle_outlook.py): the live
trajectories by phase and the turns ahead, checked number by number on known pictures."""

from __future__ import annotations

import numpy as np
import pytest

from proto import (
    DemandForecast,
    LifecycleSnapshot,
    RequestFinished,
    ToolCallStarted,
    TrajectoryFeatures,
    TrajectoryFinished,
    TrajectoryStarted,
    TurnSubmitted,
)
from services.forecaster.core import ForecasterCore
from services.forecaster.distributions import Distributions
from services.forecaster.ensemble import EnsemblePredictor
from services.forecaster.lifecycle import LifecyclePredictor
from services.forecaster.outlook import weighted_estimate
from services.forecaster.picture import build_picture

H = (5.0, 10.0, 30.0)


def _snapshot(
    rows: list[tuple[str, str, int, int, int]], ts: float, started_total: int = 0
) -> LifecycleSnapshot:
    """(task, state, turn, context, generated) per live trajectory."""
    feats = [
        TrajectoryFeatures(
            traj_id=f"x{i}",
            task=task,
            state=state,  # type: ignore[arg-type]
            time_in_state_s=0.5,
            turn=turn,
            context_tokens=ctx,
            generated_this_turn=gen,
        )
        for i, (task, state, turn, ctx, gen) in enumerate(rows)
    ]
    counts = {s: sum(f.state == s for f in feats) for s in ("queued", "prefill", "decode", "tool_call")}
    by_task = {
        t: {s: sum(f.state == s and f.task == t for f in feats) for s in counts}
        for t in {f.task for f in feats}
    }
    return LifecycleSnapshot(
        ts_s=ts,
        seq=1,
        counts=counts,
        counts_by_task=by_task,
        context_tokens_by_state={},
        trajectories=feats,
        started_total=started_total,
    )


def _turn(traj: str, turn: int, t: float, prompt: int, new: int) -> TurnSubmitted:
    return TurnSubmitted(
        traj_id=traj, ts_s=t, turn=turn, request_id=f"{traj}:{turn}", prompt_tokens=prompt, new_tokens=new
    )


def _done(traj: str, turn: int, t: float, prompt: int, output: int) -> RequestFinished:
    return RequestFinished(
        engine_id="e0",
        ts_s=t,
        request_id=f"{traj}:{turn}",
        traj_id=traj,
        turn=turn,
        prompt_tokens=prompt,
        cached_tokens=0,
        output_tokens=output,
    )


def test_naive_reads_the_turns_ahead_from_the_last_window() -> None:
    """Between two forecasts 10 s apart, task "code" submitted three turns (new tokens 100, 200, 600; contexts
    1,000, 2,000, 3,000), answered two (40 and 80 tokens), ended two tool calls (1 s and 3 s) and one trajectory;
    the outlook's horizon is 5 s, so half of those turns and finishes come over it. Task "math" saw no turn."""
    core = ForecasterCore("naive", horizons_s=H)
    snap0 = _snapshot([("code", "decode", 0, 500, 0)], ts=0.0, started_total=4)
    core.observe_snapshot(snap0, 0.0)
    first = core.forecast(0.0)  # opens the window: no rate can be read from a window of no length
    assert first.outlook_horizon_s == 5.0 and first.started_total == 4
    assert first.outlook[0].turns.mean == 0.0 and first.outlook[0].turns.observed == 0
    events = [
        TrajectoryStarted(traj_id="a", ts_s=0.5, task="code"),
        TrajectoryStarted(traj_id="b", ts_s=0.5, task="code"),
        TrajectoryStarted(traj_id="c", ts_s=0.5, task="code"),
        TrajectoryStarted(traj_id="m", ts_s=0.5, task="math"),
        _turn("a", 0, 1.0, 1_000, 100),
        _done("a", 0, 2.0, 1_000, 40),
        ToolCallStarted(traj_id="a", ts_s=2.0, turn=0),
        _turn("b", 0, 2.0, 2_000, 200),
        _done("b", 0, 3.0, 2_000, 80),
        ToolCallStarted(traj_id="b", ts_s=3.0, turn=0),
        _turn("a", 1, 3.0, 1_040 + 60, 60),  # a's tool call took 1 s
        _turn("b", 1, 6.0, 3_000, 920),  # b's took 3 s
        TrajectoryFinished(traj_id="c", ts_s=7.0),
    ]
    for ev in events:
        core.observe_event(ev, ev.ts_s)
    snap = _snapshot(
        [
            ("code", "prefill", 1, 1_100, 0),
            ("code", "decode", 1, 3_000, 10),
            ("math", "tool_call", 2, 800, 0),
        ],
        ts=10.0,
        started_total=4,
    )
    core.observe_snapshot(snap, 10.0)
    fc = core.forecast(10.0)
    code, math = fc.outlook
    assert (code.task, code.prefill, code.decode, code.live) == ("code", 1, 1, 2)
    assert (math.task, math.tool_call, math.live) == ("math", 1, 1)
    assert code.turns.mean == pytest.approx(4 * 5.0 / 10.0) and code.turns.observed == 2
    assert code.finished.mean == pytest.approx(1 * 5.0 / 10.0)
    assert code.new_tokens.mean == pytest.approx((100 + 200 + 60 + 920) / 4) and code.new_tokens.observed == 4
    assert code.context_tokens.mean == pytest.approx((1_000 + 2_000 + 1_100 + 3_000) / 4)
    assert code.output_tokens.mean == pytest.approx(60.0) and code.output_tokens.observed == 2
    assert code.tool_s.mean == pytest.approx(2.0) and (code.tool_s.q10, code.tool_s.q90) == pytest.approx(
        (1.2, 2.8)
    )
    assert code.turns.q10 < code.turns.q50 == code.turns.mean < code.turns.q90  # a Poisson count's spread
    # math's figures rest on nothing seen: the reader keeps its defaults
    assert (math.turns.mean, math.new_tokens.observed, math.tool_s.observed) == (0.0, 0, 0)
    # the next window starts empty
    assert core.forecast(12.0).outlook[0].new_tokens.observed == 0


def _learned() -> Distributions:
    """Task "t": every trajectory ends after exactly 10 turns, gaps of 2 s, outputs of 100 tokens, 50 new tokens
    per turn, prefill waits of 0.5 s; 50 output tokens per second per sequence."""
    d = Distributions(capacity=4096)
    for i in range(300):
        d.add("t", "gap_s", 2.0, True, turn=i % 9)
        d.add("t", "output_tokens", 100.0, turn=i % 10)
        d.add("t", "new_tokens", 50.0, turn=i % 9)
        d.add("t", "prefill_wait_s", 0.5, turn=i % 10)
        d.add("t", "turns", 10.0)
    d.add_decode_rate(50.0)
    return d


def test_lifecycle_reads_the_turns_ahead_from_its_tables_and_the_live_picture() -> None:
    """Five live trajectories: queued (a 4,000-token first prompt), in prefill at turn 2 (3,000), decoding 40 of 100
    tokens at turn 5 (2,000 context), in a tool call at turn 3 (1,000) — each with a next prefill to come — and one
    in a tool call after its tenth turn (turn index 9), which ends instead. Little's law over the tool call (2 s)
    and the decode (100 tokens at 50 a second): three trajectories there make 3 / 4 = 0.75 turns a second; each
    trajectory's share of them is its turns so far, k + 1 = 1, 3, 6, 4, 10 of 24."""
    snap = _snapshot(
        [
            ("t", "queued", 0, 4_000, 0),
            ("t", "prefill", 2, 3_000, 0),
            ("t", "decode", 5, 2_000, 40),
            ("t", "tool_call", 3, 1_000, 0),
            ("t", "tool_call", 9, 9_000, 0),
        ],
        ts=100.0,
    )
    p = LifecyclePredictor(horizons_s=H, seed=0, min_task_samples=20)
    p.observe(build_picture(snap, _learned()), 100.0)
    p.refit(100.0)
    (t,) = p.outlook(100.0, 5.0) or []
    assert (t.queued, t.prefill, t.decode, t.tool_call) == (1, 1, 1, 2)
    assert (t.new_tokens.mean, t.output_tokens.mean, t.tool_s.mean) == pytest.approx((50.0, 100.0, 2.0))
    assert t.new_tokens.q10 == t.new_tokens.q90 == 50.0 and t.tool_s.observed >= 300
    # next prefills: 4,000 and 3,000 as they are; 2,000 + 60 left to answer + 50 new; 1,000 + 50; the last none,
    # weighed by their shares 1, 3, 6, 4
    assert t.context_tokens.mean == pytest.approx((4_000 * 1 + 3_000 * 3 + 2_110 * 6 + 1_050 * 4) / 14)
    assert t.context_tokens.observed == 4
    assert (t.context_tokens.q10, t.context_tokens.q50, t.context_tokens.q90) == (1_050, 2_110, 3_000)
    assert t.turns.mean == pytest.approx(0.75 * 5.0)
    assert t.finished.mean == pytest.approx(0.75 * 5.0 * 10 / 24)  # the tenth-turn one's share ends
    # the ensemble passes on its lifecycle member's outlook; a series predictor has none of its own
    ens = EnsemblePredictor(horizons_s=H, members=["naive", p])
    assert ens.outlook(100.0, 5.0) == p.outlook(100.0, 5.0)
    assert EnsemblePredictor(horizons_s=H, members=["naive", "ewma"]).outlook(100.0, 5.0) is None


def test_each_task_of_a_mix_has_its_own_figures_where_it_has_a_few_samples() -> None:
    """A mix: task "m" has only 5 answers of its own (3,000 tokens, too few for tables of its own) and no tool call
    yet; task "u" has nothing. "m" reads its own outputs and the pooled tool calls, "u" the pooled figures."""
    d = _learned()
    for _ in range(5):
        d.add("m", "output_tokens", 3_000.0, turn=0)
    snap = _snapshot(
        [("t", "decode", 1, 2_000, 10), ("m", "decode", 0, 500, 100), ("u", "tool_call", 0, 700, 0)], ts=100.0
    )
    p = LifecyclePredictor(horizons_s=H, seed=0, min_task_samples=20)
    p.observe(build_picture(snap, d), 100.0)
    p.refit(100.0)
    t, m, u = p.outlook(100.0, 5.0) or []
    assert (t.task, m.task, u.task) == ("t", "m", "u")
    assert m.output_tokens.mean == pytest.approx(3_000.0) and m.output_tokens.observed == 5
    assert m.tool_s.mean == pytest.approx(2.0) and m.tool_s.observed >= 300  # the pooled gaps
    assert m.context_tokens.mean == pytest.approx(500 + 2_900 + 50)  # the rest of a 3,000-token answer
    assert u.output_tokens.mean == pytest.approx(
        (300 * 100 + 5 * 3_000) / 305
    )  # the pooled task's, "m"'s too
    # one decoding trajectory a task: a 3,000-token answer takes 60 s, a 100-token one 2 s
    assert m.turns.mean == pytest.approx(5.0 / (2.0 + 60.0)) and t.turns.mean == pytest.approx(5.0 / 4.0)


def test_before_its_first_refit_lifecycle_says_its_figures_are_priors() -> None:
    snap = _snapshot([("t", "tool_call", 0, 1_000, 0)], ts=1.0)
    p = LifecyclePredictor(horizons_s=H, seed=0)
    p.observe(build_picture(snap, Distributions()), 1.0)
    (t,) = p.outlook(1.0, 5.0) or []
    assert (t.tool_s.observed, t.output_tokens.observed, t.new_tokens.observed) == (0, 0, 0)
    assert t.context_tokens.observed == 1  # a live trajectory's context is no prior


def test_no_outlook_before_a_snapshot_and_the_lifecycle_core_publishes_its_own() -> None:
    core = ForecasterCore("lifecycle", horizons_s=H)
    fc = core.forecast(0.0)
    assert (fc.outlook, fc.outlook_horizon_s) == ([], 0.0)
    core.observe_snapshot(_snapshot([("t", "decode", 0, 700, 3)], ts=1.0, started_total=9), 1.0)
    fc = core.forecast(1.0)
    assert isinstance(fc, DemandForecast) and fc.started_total == 9 and fc.outlook_horizon_s == 5.0
    assert fc.outlook[0].decode == 1 and fc.outlook[0].context_tokens.mean > 700


def test_weighted_quantiles_and_held_limits() -> None:
    e = weighted_estimate(np.array([1.0, 2.0, 3.0, 1e12]), np.array([1.0, 0.0, 1.0, 2.0]), limit=100.0)
    assert e.observed == 3 and e.mean == pytest.approx((1 + 3 + 200) / 4)
    assert (e.q10, e.q50, e.q90) == (1.0, 3.0, 100.0)

"""Forecaster robustness: bad input counted and skipped, calibrated bands, the next step learnt, the old name."""

from __future__ import annotations

import math

import numpy as np
import pytest

from proto import (
    LifecycleSnapshot,
    ProgressItem,
    TokenProgress,
    TrajectoryFeatures,
    TrajectoryFinished,
    TrajectoryStarted,
    TurnSubmitted,
)
from services.forecaster.base import REGISTRY, make_predictor
from services.forecaster.calibration import K_MAX, Calibrator
from services.forecaster.core import ForecasterCore
from services.forecaster.series import METRICS, SeriesPoint
from services.forecaster.steps import StepLearner

H = (5.0, 10.0)


def _feat(
    tid: str, state: str = "tool_call", tis: float = 1.0, ctx: int = 1000, turn: int = 1, task: str = "t"
):
    return TrajectoryFeatures(
        traj_id=tid,
        task=task,
        state=state,
        time_in_state_s=tis,
        turn=turn,
        context_tokens=ctx,
        generated_this_turn=0,
    )


def _snap(ts: float, feats: list, decode: float = 0, kv: float = 0) -> LifecycleSnapshot:
    return LifecycleSnapshot(
        ts_s=ts,
        seq=1,
        counts={"decode": decode},  # type: ignore[dict-item]
        counts_by_task={},
        context_tokens_by_state={"decode": kv},  # type: ignore[dict-item]
        trajectories=feats,
    )


def _finite(fc) -> bool:
    return all(
        math.isfinite(v) and v >= 0
        for hf in fc.horizons
        for q in (hf.prefill_tokens, hf.decode_tokens, hf.decode_concurrency, hf.kv_tokens)
        for v in (q.q10, q.q50, q.q90)
    )


@pytest.mark.parametrize("predictor", ["naive", "lifecycle", "ensemble"])
def test_bad_snapshots_are_counted_and_skipped_and_forecasts_stay_finite(predictor: str) -> None:
    core = ForecasterCore(
        predictor,
        horizons_s=H,
        predictor_options={"members": ("naive", "lifecycle")} if predictor == "ensemble" else None,
    )
    good = [_feat("a"), _feat("b", "decode")]
    bad = [
        _feat("c", tis=math.nan),
        _feat("d", tis=-3.0),
        _feat("e", ctx=10**12),  # absurd: more context than any model holds
        _feat("f", tis=1e9),  # absurd: 30 years in a tool call
        _feat("a"),  # seen twice in one snapshot
        _feat("g", task="never-seen"),  # an unknown task: fine, pooled distributions
    ]
    for k in range(1, 30):
        core.observe_snapshot(_snap(float(k), good + bad, decode=math.nan, kv=-5.0), float(k))
        assert _finite(core.forecast(float(k)))
    core.observe_snapshot(_snap(3.0, good), 30.0)  # older than the last one: out of order
    core.observe_snapshot(_snap(math.inf, good), 30.0)
    core.observe_event(TrajectoryStarted(traj_id="z", source="d", ts_s=1.0, seq=1), math.nan)
    assert _finite(core.forecast(31.0))
    r = core.rejected
    assert r["invalid_time_in_state_s"] == 2 * 29
    assert r["absurd_context_tokens"] == 29 and r["absurd_time_in_state_s"] == 29
    assert r["duplicate_traj"] == 29
    assert r["snapshot_out_of_order"] == 1 and r["snapshot_time_not_finite"] == 1
    assert r["event_time_not_finite"] == 1
    assert "invalid_task" not in r  # an unknown task is not bad input


def test_duplicate_late_and_absurd_events_add_nothing() -> None:
    core = ForecasterCore("lifecycle", horizons_s=H)
    start = TrajectoryStarted(traj_id="x", source="d", ts_s=0.0, seq=1, task="t", policy_version=0)
    turn = TurnSubmitted(
        traj_id="x", source="d", ts_s=0.5, seq=2, turn=0, request_id="x:0", prompt_tokens=500
    )
    for ev in (start, start, turn, turn):  # each seen twice
        core.observe_event(ev, 0.5)
    late = TurnSubmitted(
        traj_id="x", source="d", ts_s=0.4, seq=3, turn=0, request_id="x:0b", prompt_tokens=900
    )
    core.observe_event(late, 0.6)  # an older turn index after a newer one: out of order
    huge = TokenProgress(
        engine_id="e",
        ts_s=0.7,
        seq=1,
        items=[ProgressItem(request_id="x:0", traj_id="x", turn=0, output_tokens=2**40)],
    )
    core.observe_event(huge, 0.7)
    core.observe_event(TrajectoryFinished(traj_id="x", source="d", ts_s=1.0, seq=4), 1.0)
    core.observe_event(TrajectoryFinished(traj_id="x", source="d", ts_s=1.0, seq=4), 1.0)
    core.observe_event(start, 1.1)  # a late duplicate of an ended trajectory: not live again
    points = [*core.series, *core.learner.windower.advance(2.0)]
    assert sum(p.prefill_tokens for p in points) == 500 and sum(p.decode_tokens for p in points) == 0
    assert core.learner.rejected["absurd_output_tokens"] == 1
    assert core.distributions.steps.live == 0


def _point(t: float, value: float) -> SeriesPoint:
    return SeriesPoint(t, 1.0, value, value, value, value)


def test_calibrator_widens_a_band_that_is_too_narrow() -> None:
    """Noise ~ N(100, 20) per 1 s window; the model claims q10..q90 = q50 ± 1 token. Calibrated, 80 % of the
    matured actuals fall inside and 90 % below q90."""
    rng = np.random.default_rng(0)
    cal = Calibrator((5.0,), 1.0)
    inside = below = n = 0
    history: list[tuple[float, tuple[float, float, float]]] = []
    values = rng.normal(100.0, 20.0, 3000)
    for k, v in enumerate(values):
        t = float(k)
        cal.observe(_point(t, float(v)))
        raw = {m: [(499.0, 500.0, 501.0)] for m in METRICS}
        out = cal.adjust(t, (5.0,), raw)
        history.append((t, out["prefill_tokens"][0]))
    for t, (q10, _, q90) in history[1000:-6]:
        k = int(t)
        actual = float(values[k + 1 : k + 6].sum())  # windows ending at t+1..t+5 cover (t, t+5]
        inside += q10 <= actual <= q90
        below += actual <= q90
        n += 1
    assert 0.76 <= inside / n <= 0.84 and 0.86 <= below / n <= 0.94, (inside / n, below / n)


def test_calibrator_leaves_the_median_alone_and_ignores_other_horizons() -> None:
    cal = Calibrator((5.0,), 1.0, min_scores=1)
    for k in range(40):
        cal.observe(_point(float(k), 1000.0))
        cal.adjust(float(k), (5.0,), {m: [(0.0, 10.0, 20.0)] for m in METRICS})
    out = cal.adjust(41.0, (5.0, 7.0), {m: [(0.0, 10.0, 20.0), (1.0, 2.0, 3.0)] for m in METRICS})
    assert all(row[0][1] == 10.0 and row[1][1] == 2.0 for row in out.values())
    # Actual 5 000 every time, 500x the model's median: the band moves up, by the bounded rule — at most K_MAX
    # times the model's half-width or the floor f S (S = 5 000: the floor is 250), never further.
    q10, q50, q90 = out["prefill_tokens"][0]
    assert q90 == pytest.approx(10.0 + K_MAX * 0.05 * 5000.0) and q10 == q50 == 10.0


def test_step_learner_predicts_the_next_step_after_one_boundary() -> None:
    s = StepLearner()
    assert s.expected(0.0) == []
    for v, t0 in ((0, 0.0), (1, 160.0)):
        for i in range(3):
            s.started(f"s{v}-{i}", v, t0)
            s.first_turn(f"s{v}-{i}", 1000.0 + i, "t", t0 + 0.1 * i)
        if v == 0:
            assert s.expected(50.0) == []  # a step is running: nothing is drained
            for i in range(3):
                s.finished(f"s{v}-{i}", 100.0)
            assert s.expected(110.0) == []  # no boundary seen yet: no prior on training time
    assert list(s.gaps_s) == [60.0]
    for i in range(3):
        s.finished(f"s1-{i}", 300.0)
    (sc,) = s.expected(330.0)
    assert sc.weight == 1.0 and sc.start_s == 360.0
    assert [a[:2] for a in sc.arrivals] == [
        (0.0, 1000.0),
        (pytest.approx(0.1), 1001.0),
        (pytest.approx(0.2), 1002.0),
    ]
    assert s.expected(361.0) == []  # later than every gap seen: maybe the run is over


def test_lifecycle_forecasts_the_next_step_burst_while_drained() -> None:
    core = ForecasterCore("lifecycle", horizons_s=H)
    seq = iter(range(1, 10**6))

    def ev(cls, tid: str, t: float, **kw):
        core.observe_event(cls(traj_id=tid, source="d", ts_s=t, seq=next(seq), **kw), t)

    for v, t0 in ((0, 0.0), (1, 100.0)):
        for i in range(4):
            ev(TrajectoryStarted, f"s{v}-{i}", t0, task="t", policy_version=v)
            ev(TurnSubmitted, f"s{v}-{i}", t0, turn=0, request_id=f"s{v}-{i}:0", prompt_tokens=2000)
        for i in range(4):
            ev(TrajectoryFinished, f"s{v}-{i}", t0 + 40.0, turns=1)
    # drained at 140; the last boundary took 60 s: the next 8,000 first-prompt tokens come at 200
    core.observe_snapshot(_snap(193.0, []), 193.0)
    fc = core.forecast(193.0)
    assert fc.horizons[0].prefill_tokens.q50 == 0.0  # (193, 198]: not yet
    assert fc.horizons[1].prefill_tokens.q50 == pytest.approx(8000.0)  # (193, 203]: the burst
    off = ForecasterCore("lifecycle", horizons_s=H, predictor_options={"next_step": False})
    assert off.predictor.next_step is False


def test_prorsa_is_a_deprecated_alias_of_the_ensemble() -> None:
    assert "prorsa" not in REGISTRY and "ensemble" in REGISTRY
    with pytest.warns(DeprecationWarning, match="ensemble"):
        p = make_predictor("prorsa", horizons_s=H, members=("naive",))
    assert p.name == "ensemble"
    with pytest.warns(DeprecationWarning):
        assert (
            ForecasterCore("prorsa", horizons_s=H, predictor_options={"members": ("naive",)}).name
            == "ensemble"
        )

"""Forecaster: the series and its demand definitions, the event learner, the series predictors, the core."""

from __future__ import annotations

import ast
import inspect
import math
import warnings

import numpy as np
import pytest

import services.forecaster.base as base_mod
import services.forecaster.core as core_mod
import services.forecaster.distributions as dist_mod
import services.forecaster.ensemble as ensemble_mod
import services.forecaster.learner as learner_mod
import services.forecaster.lifecycle as lifecycle_mod
import services.forecaster.lifecycle_model as lifecycle_model_mod
import services.forecaster.lifecycle_outlook as lifecycle_outlook_mod
import services.forecaster.lifecycle_tables as lifecycle_tables_mod
import services.forecaster.outlook as outlook_mod
import services.forecaster.picture as picture_mod
import services.forecaster.series as series_mod
import services.forecaster.simple as simple_mod
import services.forecaster.statespace as statespace_mod
from prorsa.bench.synthetic import SyntheticWorkload, generate_events
from proto import DemandForecast
from services.forecaster.base import REGISTRY, make_predictor
from services.forecaster.core import ForecasterCore
from services.forecaster.distributions import Distributions
from services.forecaster.learner import EventLearner
from services.forecaster.series import METRICS, SeriesPoint, Windower, realised
from services.forecaster.statespace import KalmanState, extract_fit
from services.trajectory_tracker.core import TrackerCore

HORIZONS = (5.0, 10.0, 30.0)


def test_core_modules_import_no_io_clock_or_random() -> None:
    mods = (
        base_mod,
        core_mod,
        dist_mod,
        ensemble_mod,
        learner_mod,
        lifecycle_mod,
        lifecycle_model_mod,
        lifecycle_outlook_mod,
        lifecycle_tables_mod,
        outlook_mod,
        picture_mod,
        series_mod,
        simple_mod,
        statespace_mod,
    )
    for mod in mods:
        tree = ast.parse(inspect.getsource(mod))
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {
            n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
        }
        assert not names & {"asyncio", "nats", "time", "random"}, (mod.__name__, names)


def test_registry_names() -> None:
    make_predictor("naive")
    assert set(REGISTRY) == {"naive", "ewma", "ets", "arima", "lifecycle", "ensemble"}
    with pytest.raises(KeyError, match="unknown predictor 'nope'.*naive"):
        make_predictor("nope")


# --- the series -------------------------------------------------------------------------------------------------


def test_windower_cuts_flows_by_time_and_carries_levels() -> None:
    w = Windower(1.0)
    assert w.add_flow(0.2, prefill_tokens=10) == []
    w.set_levels(0.5, 3, 300)
    w.add_flow(0.9, decode_tokens=5)
    closed = w.add_flow(2.5, prefill_tokens=7)  # closes [0,1) and the empty [1,2)
    assert [
        (p.end_s, p.prefill_tokens, p.decode_tokens, p.decode_concurrency, p.kv_tokens) for p in closed
    ] == [
        (1.0, 10, 5, 3, 300),
        (2.0, 0, 0, 3, 300),
    ]
    w.add_flow(2.0, prefill_tokens=1)  # late (before the open window): counted in the open window
    assert w.advance(3.0)[0].prefill_tokens == 8


def test_realised_demand_definitions() -> None:
    pts = [SeriesPoint(float(k + 1), 1.0, 10.0 * (k + 1), 1.0, float(k), 100.0 * k) for k in range(10)]
    a = realised(pts, 2.5, 3.0)  # (2.5, 5.5]: half of window [2,3), windows [3,4) [4,5), half of [5,6)
    assert a is not None
    assert a["prefill_tokens"] == pytest.approx(0.5 * 30 + 40 + 50 + 0.5 * 60)
    assert a["decode_tokens"] == pytest.approx(3.0)
    assert a["decode_concurrency"] == pytest.approx((0.5 * 2 + 3 + 4 + 0.5 * 5) / 3)
    assert a["kv_tokens"] == 500.0  # the window holding 5.5
    assert realised(pts, 8.0, 5.0) is None  # not covered yet


# --- the event learner --------------------------------------------------------------------------------------------


def _run_learner(events: list) -> tuple[EventLearner, list[SeriesPoint]]:
    learner = EventLearner(Windower(1.0), Distributions())
    pts: list[SeriesPoint] = []
    for t, ev in events:
        pts += learner.observe(ev, t)
    pts += learner.windower.advance(events[-1][0] + 2.0)
    return learner, pts


def test_learner_flows_match_the_tracker_and_ignore_duplicates() -> None:
    events = generate_events(SyntheticWorkload(trajectories=30, seed=5))
    tracker = TrackerCore()
    for t, ev in events:
        tracker.apply(ev, t)
    doubled = [x for pair in zip(events, events, strict=True) for x in pair]  # every event delivered twice
    learner, pts = _run_learner(doubled)
    assert sum(p.prefill_tokens for p in pts) == tracker.prefill_tokens_total
    assert sum(p.decode_tokens for p in pts) == tracker.decode_tokens_total
    d = learner.distributions
    assert d.count("*", "output_tokens") == sum(
        a.output_tokens_per_turn.total for a in tracker.aggregates().values()
    )
    assert d.count("*", "turns") == 30


def test_learner_distributions_follow_the_workload() -> None:
    w = SyntheticWorkload(trajectories=200, tool_latency_mean_s=2.0, decode_rate_tokens_per_s=40.0, seed=6)
    learner, _ = _run_learner(generate_events(w))
    view = learner.distributions.freeze()
    s = view.tasks["*"]
    turn_gaps = s.gap_s[s.gap_is_turn]
    assert turn_gaps.mean() == pytest.approx(2.0, rel=0.1)
    assert (s.gap_s[~s.gap_is_turn] < 1e-9).all()  # the last turn ends the trajectory at once
    assert view.decode_rate_tokens_per_s == pytest.approx(40.0, rel=0.02)
    assert s.prefill_wait_s.mean() == pytest.approx(w.prefill_wait_s, abs=1e-6)
    assert np.median(s.new_tokens) == pytest.approx(w.new_tokens_median, rel=0.1)
    assert set(view.tasks) == {"*", "coding", "math"}


# --- series predictors ---------------------------------------------------------------------------------------------


def _stationary(n: int, seed: int, mean: float = 1000.0) -> list[SeriesPoint]:
    rng = np.random.default_rng(seed)
    x = np.empty(n)
    level = 0.0
    for i in range(n):
        level = 0.5 * level + rng.normal(0.0, 50.0)
        x[i] = mean + level
    return [SeriesPoint(float(i + 1), 1.0, x[i], 0.5 * x[i], x[i] / 100.0, 10.0 * x[i]) for i in range(n)]


@pytest.mark.parametrize("name", ["naive", "ewma", "ets", "arima"])
def test_series_predictors_are_close_to_the_truth_on_a_stationary_series(name: str) -> None:
    p = make_predictor(name, horizons_s=HORIZONS)
    for pt in _stationary(100, seed=1):
        p.observe(pt, pt.end_s)
    p.refit(100.0)
    fc = p.predict(100.0)
    tol = 0.25 if name == "naive" else 0.1  # naive carries the last window's noise
    for hf in fc.horizons:
        k = hf.horizon_s
        assert hf.prefill_tokens.q50 == pytest.approx(1000.0 * k, rel=tol), (name, k)
        assert hf.decode_tokens.q50 == pytest.approx(500.0 * k, rel=tol)
        assert hf.decode_concurrency.q50 == pytest.approx(10.0, rel=tol)
        assert hf.kv_tokens.q50 == pytest.approx(10000.0, rel=tol)
        assert hf.prefill_tokens.q10 < 1000.0 * k < hf.prefill_tokens.q90


def test_statespace_predictors_fall_back_until_fitted_and_refit_keeps_up() -> None:
    p = make_predictor("ets", horizons_s=HORIZONS)
    pts = _stationary(50, seed=2)
    for pt in pts[:40]:
        p.observe(pt, pt.end_s)
    assert p.states == {}
    job = p.refit_job(40.0)
    assert job is not None
    for pt in pts[40:]:  # windows arriving while the job "runs"
        p.observe(pt, pt.end_s)
    p.install(job())
    assert set(p.states) == set(METRICS)
    ref = make_predictor("ets", horizons_s=HORIZONS)
    for pt in pts[:40]:
        ref.observe(pt, pt.end_s)
    ref.install(job())  # the same fit (a pure job gives the same result twice)
    for pt in pts[40:]:
        ref.observe(pt, pt.end_s)
    assert p.predict(50.0).horizons == ref.predict(50.0).horizons  # caught up on the windows it missed


def test_kalman_forecast_matches_statsmodels_and_simulation() -> None:
    from statsmodels.tsa.arima.model import ARIMA

    rng = np.random.default_rng(3)
    y = 5.0 + np.cumsum(rng.normal(0, 1, 80)) * 0.2 + rng.normal(0, 1, 80)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = ARIMA(y, order=(1, 0, 1), trend="c").fit()
    fit = extract_fit(res, 1.0)
    ks = KalmanState(fit)
    fc = res.get_forecast(10)
    for k in (1, 4, 10):
        _, _, y_mean, y_var = ks.forecast(k)
        assert y_mean == pytest.approx(fc.predicted_mean[k - 1], rel=1e-6)
        assert y_var == pytest.approx(fc.var_pred_mean[k - 1], rel=1e-6)
    # the variance of a sum, against a simulation of the same state-space system
    s_mean, s_var, _, _ = ks.forecast(10)
    sims = np.empty(20000)
    a = rng.multivariate_normal(fit.a, fit.P, size=len(sims))
    total = np.zeros(len(sims))
    chol = np.linalg.cholesky(fit.RQR + 1e-12 * np.eye(len(fit.a)))
    for _ in range(10):
        total += a @ fit.Z + fit.d + rng.normal(0, math.sqrt(fit.H), len(sims))
        a = fit.c + a @ fit.T.T + rng.normal(size=a.shape) @ chol.T
    assert s_mean == pytest.approx(sims.size and total.mean(), rel=0.01)
    assert s_var == pytest.approx(total.var(), rel=0.05)


def test_bad_points_are_sanitised_once() -> None:
    p = make_predictor("ewma")
    p.observe(SeriesPoint(1.0, 1.0, math.nan, -5.0, math.inf, 10.0), 1.0)
    p.observe(SeriesPoint(1.0, 1.0, 1.0, 1.0, 1.0, 1.0), 1.0)  # not newer: dropped
    assert p.sanitised == 2 and p.points == 1
    fc = p.predict(1.0)
    assert fc.horizons[0].prefill_tokens.q50 == 0.0 and fc.horizons[0].kv_tokens.q50 == 10.0


# --- every predictor, through the core ------------------------------------------------------------------------------


def _drive(core: ForecasterCore, events: list, until_s: float) -> None:
    tracker = TrackerCore()
    nxt = 1.0
    for t, ev in events:
        if t > until_s:
            break
        while t >= nxt:
            core.observe_snapshot(tracker.snapshot(nxt))
            nxt += 1.0
        tracker.apply(ev, t)
        core.observe_event(ev, t)


def test_every_predictor_returns_ordered_non_negative_quantiles_for_every_horizon() -> None:
    opts = {
        "member_options": {
            "ets": {"fit_points": 40},
            "arima": {"fit_points": 40},
            "lifecycle": {"paths": 512},
        }
    }
    core = ForecasterCore("ensemble", horizons_s=HORIZONS, predictor_options={**opts, "seed": 1})
    events = generate_events(SyntheticWorkload(trajectories=50, arrival_spread_s=20.0, seed=7))
    _drive(core, events, until_s=45.0)
    core.refit(45.0)
    predictors = [core.predictor, *core.predictor.members]
    assert sorted(p.name for p in predictors) == sorted(REGISTRY)
    for p in predictors:
        fc = p.predict(45.0)
        assert isinstance(fc, DemandForecast) and fc.predictor == p.name
        assert [h.horizon_s for h in fc.horizons] == list(HORIZONS)
        for hf in fc.horizons:
            for m in METRICS:
                q = getattr(hf, m)
                assert 0.0 <= q.q10 <= q.q50 <= q.q90 and math.isfinite(q.q90), (p.name, m, q)
        assert fc.horizons[-1].decode_tokens.q50 > 0.0, p.name
    assert core.series and realised(list(core.series), 30.0, 5.0) is not None
    out = core.forecast(45.0, horizons=(7.0,))
    assert [h.horizon_s for h in out.horizons] == [7.0] and out.snapshot_ts_s == core.last_snapshot_ts_s


def test_a_kinds_first_sample_makes_a_refit_due_at_once() -> None:
    """A kind on its prior (a round stand-in: 256 output tokens) is replaced at its first sample, not after 20
    observations: on azure-code the prior outlived the first answers by 4 s and cost most of the decode error."""
    from proto import LifecycleSnapshot

    core = ForecasterCore("lifecycle", refit_interval_s=30.0)
    empty = LifecycleSnapshot(
        ts_s=0.0, seq=1, counts={}, counts_by_task={}, context_tokens_by_state={}, trajectories=[]
    )
    core.observe_snapshot(empty, 0.0)
    assert core.refit_due(0.0) and core.refit_job(0.0) is not None  # the first fit, on the priors
    core.distributions.add("general", "queue_wait_s", 0.5)
    core.refit(0.5)  # a first queue wait: refitted
    assert not core.refit_due(1.0)
    core.distributions.add("general", "queue_wait_s", 0.7)  # the same kind again: not due
    assert not core.refit_due(1.0)
    core.distributions.add("general", "output_tokens", 24.0)  # the run's first answer
    assert core.refit_due(1.0)

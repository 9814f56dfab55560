"""`prorsa forecast-eval`: the simulator bridge, exact realised demand, scoring, hints, the CLI and its JSON."""

from __future__ import annotations

import json
import math
import time
from collections import Counter

import numpy as np
import pytest

from prorsa.bench.synthetic import SyntheticWorkload, generate_events
from prorsa.cli import main
from prorsa.forecast_eval.bank import ForecastBank
from prorsa.forecast_eval.bridge import SimBridge
from prorsa.forecast_eval.evaluate import EvalOptions, run_forecast_eval
from prorsa.forecast_eval.hints import ArrivalSchedule, RecordingWorkload
from prorsa.forecast_eval.ledger import DemandLedger
from prorsa.forecast_eval.scoring import coverage_below, coverage_within, score, wape
from prorsa.sim.runner import SimConfig, run_simulation
from prorsa.workload.types import TrajectorySpec, Turn
from proto import TokenProgress
from services.forecaster.base import MetricForecast, Predictor
from services.forecaster.series import FLOW_METRICS, METRICS
from services.trajectory_tracker.core import TrackerCore

TINY = dict(workload="profile:coding", engines=2, batch_size=6, steps=1, training_s=5.0, seed=3)
SHORT = dict(TINY, duration_s=120.0)  # the run cut at 120 s of its ~340
FAST = EvalOptions(predictors=("naive",), horizons_s=(5.0, 10.0))


# --- exact accounting and scoring ---------------------------------------------------------------------------------


def test_ledger_realised_demand_is_exact() -> None:
    led = DemandLedger()
    led.add_prefill(1.0, 100)
    led.add_prefill(4.5, 50)
    led.add_decode(0.0, 10.0, 1000)  # 100 tokens/s
    led.add_decode(2.0, 2.0, 7)  # a point mass at 2
    starts = np.array([0.0, 1.0, 3.0, 10.0])
    assert led.realised("prefill_tokens", starts, 4.0).tolist() == [100.0, 50.0, 50.0, 0.0]  # (t, t+4]
    assert led.realised("decode_tokens", starts, 4.0) == pytest.approx([407.0, 407.0, 400.0, 0.0])
    assert led.cumulative("decode_tokens", np.array([100.0]))[0] == pytest.approx(1007.0)
    with pytest.raises(ValueError, match="kv_tokens"):
        led.cumulative("kv_tokens", starts)


def test_scores_of_perfect_and_known_forecasts() -> None:
    actual = np.array([10.0, 0.0, 30.0])
    assert wape(actual, actual) == 0.0
    assert wape(np.zeros(3), actual) == 1.0
    assert wape(np.array([12.0, 1.0, 27.0]), actual) == pytest.approx(6.0 / 40.0)
    assert math.isnan(wape(np.ones(2), np.zeros(2)))
    assert coverage_below(np.array([10.0, 0.0, 29.0]), actual) == pytest.approx(2 / 3)
    assert coverage_within(np.array([9.0, 0.0, 31.0]), np.array([11.0, 1.0, 40.0]), actual) == pytest.approx(
        2 / 3
    )
    # the (tick, horizon, metric, quantile) layout: one perfect and one biased metric, one invalid tick
    act = np.arange(1.0, 13.0).reshape(3, 2, 2)
    fc = np.stack([act, act, act], axis=-1)
    fc[..., 1, :] *= 2.0  # decode forecast twice the actual: WAPE 1, never covered from below by q10
    valid = np.array([[True, True], [True, True], [False, True]])
    rows = score(fc, act, valid, ("prefill_tokens", "decode_tokens"))
    assert [r["forecasts"] for r in rows] == [2, 3]
    assert rows[0]["prefill_wape"] == 0.0 and rows[0]["decode_wape"] == pytest.approx(1.0)
    assert rows[0]["prefill_coverage80"] == 1.0 and rows[0]["decode_coverage80"] == 0.0
    assert rows[0]["coverage90"] == 1.0 and rows[0]["coverage80"] == 0.5


# --- the bridge -----------------------------------------------------------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, dict]] = []

    def on_event(self, kind: str, traj_id: str, now: float, **fields: object) -> None:
        self.events.append((kind, traj_id, now, fields))


def test_bridge_numbers_each_source_and_batches_progress_per_engine_step() -> None:
    rec = _Recorder()
    run_simulation(SimConfig(**TINY, observer=rec))
    bridge = SimBridge()
    for kind, traj_id, now, fields in rec.events:
        bridge.on_event(kind, traj_id, now, **fields)
    released = bridge.release(math.inf)
    seqs: dict[str, list[int]] = {}
    for _, msg in released:
        seqs.setdefault(getattr(msg, "engine_id", None) or msg.source, []).append(msg.seq)
    assert seqs and all(s == list(range(1, len(s) + 1)) for s in seqs.values())
    times = [t for t, _ in released]
    assert times == sorted(times)
    progress = [m for _, m in released if isinstance(m, TokenProgress)]
    items = sum(len(m.items) for m in progress)
    assert items == Counter(k for k, *_ in rec.events)["decode_progress"]
    assert len(progress) < items  # several sequences of one engine step share one message
    assert len({(m.engine_id, m.ts_s) for m in progress}) == len(progress)


def test_bridge_gives_the_tracker_the_simulators_trajectories_and_tokens() -> None:
    result = run_forecast_eval(SimConfig(**TINY), FAST)
    m = result.sim.sim.metrics
    tracker = result.tracker
    assert result.bad_rejections == {}
    assert tracker.totals["finished"] == m.trajectories_completed == 6
    assert tracker.live_count == 0
    assert tracker.prefill_tokens_total == result.bridge.ledger.prefill_total_tokens == m.new_prompt_tokens
    assert tracker.decode_tokens_total == result.bridge.ledger.decode_total_tokens == m.decoded_tokens
    # realised demand over the whole run, from the ledger, adds up to the totals
    whole = result.bridge.ledger.realised("decode_tokens", np.array([-1.0]), result.sim.end_s + 2.0)
    assert whole[0] == pytest.approx(m.decoded_tokens)


def test_progress_between_reports_is_interpolated_and_waits_for_the_report() -> None:
    b = SimBridge()
    b.on_event("trajectory_started", "a", 0.0, attempt=0, step=0, task="t", prompt_tokens=10, turns=1)
    b.on_event("turn_submitted", "a", 0.0, attempt=0, turn=0, context_tokens=10, new_tokens=10)
    b.on_event(
        "prefill_done", "a", 0.0, attempt=0, turn=0, engine_id="e", computed_tokens=10, cached_tokens=0
    )
    b.on_event("decode_started", "a", 0.0, attempt=0, turn=0, engine_id="e", output_tokens=100)
    assert b.ready(0.0) and not b.ready(5.0)  # decoding since 0 with no report yet
    b.on_event("decode_progress", "a", 10.0, attempt=0, turn=0, engine_id="e", tokens=100, of=100)
    assert b.ready(5.0) and b.ready(50.0)
    b.release(5.0)
    (msg,) = b.progress_at(5.0)
    assert msg.items[0].output_tokens == 50 and msg.engine_id == "e"
    assert b.ledger.realised("decode_tokens", np.array([0.0]), 5.0)[0] == pytest.approx(50.0)


def test_a_perfect_predictor_scores_zero() -> None:
    """The simulator is deterministic: a stub that answers with the first run's realised demand is perfect. Its
    forecasts pass through the demand bound like every predictor's (services/forecaster/bounds.py): the truth
    is physically possible, so the bound never clips it."""
    truth = run_forecast_eval(SimConfig(**SHORT), FAST)

    class Oracle(Predictor):
        name = "oracle"

        def _forecast(self, now: float, horizons: tuple[float, ...]) -> MetricForecast:
            out: MetricForecast = {m: [(0.0, 0.0, 0.0)] * len(horizons) for m in METRICS}
            for m in FLOW_METRICS:
                vals = [float(truth.bridge.ledger.realised(m, np.array([now]), h)[0]) for h in horizons]
                out[m] = [(v, v, v) for v in vals]
            return out

    result = run_forecast_eval(SimConfig(**SHORT), FAST, extra_predictors={"oracle": Oracle((5.0, 10.0))})
    assert result.valid[:, 1].sum() > 100
    for row in result.scores["oracle"]:
        assert row["prefill_wape"] == pytest.approx(0.0, abs=1e-9)
        assert row["decode_wape"] == pytest.approx(0.0, abs=1e-9)
        assert row["coverage90"] == row["coverage80"] == 1.0
    assert result.scores["naive"][1]["prefill_wape"] > 0.1  # the scoring can fail
    exceeded = result.bound_exceeded()
    assert exceeded["prefill_share"] == exceeded["decode_share"] == 0.0
    assert 0.0 < exceeded["prefill_max_ratio"] <= 1.0 and 0.0 < exceeded["decode_max_ratio"] <= 1.0


def test_ensemble_members_are_scored_as_standalone_predictors() -> None:
    """Scoring naive and lifecycle from inside the prorsa ensemble gives their standalone forecasts."""
    events = generate_events(SyntheticWorkload(trajectories=40, arrival_spread_s=10.0, seed=2))
    shared = ForecastBank(("naive", "lifecycle", "ensemble"), horizons_s=(5.0, 10.0))
    alone = ForecastBank(("naive", "lifecycle"), horizons_s=(5.0, 10.0))
    assert set(shared.cores) == {"ensemble"}
    tracker = TrackerCore()
    nxt = 1.0
    for t, ev in events:
        if t > 25.0:
            break
        while t >= nxt:
            snap = tracker.snapshot(nxt)
            a, b = shared.tick(snap, nxt), alone.tick(snap, nxt)
            for name in ("naive", "lifecycle"):
                np.testing.assert_allclose(a[name], b[name], rtol=1e-12)
            nxt += 1.0
        tracker.apply(ev, t)
        shared.observe_event(ev, t)
        alone.observe_event(ev, t)
    assert nxt > 20.0


# --- hints ----------------------------------------------------------------------------------------------------------


class _Steps:
    name = "steps"

    def step(self, index: int) -> list[TrajectorySpec]:
        turns = (Turn(1000 + index, 10, 0.0),)
        return [TrajectorySpec(f"s{index}-{i}", "t", turns, arrival_s=float(5 * i)) for i in range(3)]


def test_arrival_hints_know_the_submitted_step_and_optionally_the_next() -> None:
    """Events reach the schedule before the ticks that precede them are run: no hint may look ahead."""
    for mode, expect_next in (("started", False), ("schedule", True)):
        sched = ArrivalSchedule(RecordingWorkload(_Steps()), mode, sync=True, training_s=60.0, steps=3)
        assert sched.pending(0.0) == ()  # nothing submitted yet
        sched.started(0, "s0-0", 0, 100.0)  # the step was submitted at 100 (its first arrival, offset 0)
        assert [(p.at_s, p.prompt_tokens) for p in sched.pending(101.0)] == [(105.0, 1000), (110.0, 1000)]
        sched.started(0, "s0-1", 0, 105.0)
        sched.started(0, "s0-2", 0, 110.0)
        assert sched.pending(111.0) == ()
        for _ in range(3):
            sched.finished(0, 150.0)
        assert sched.pending(99.0) == sched.pending(149.0) == ()  # nothing known before it happened
        got = [(p.at_s, p.prompt_tokens) for p in sched.pending(151.0)]
        assert got == ([(210.0, 1001), (215.0, 1001), (220.0, 1001)] if expect_next else [])
    assert ArrivalSchedule(RecordingWorkload(_Steps()), "none").pending(0.0) == ()
    with pytest.raises(ValueError, match="hints"):
        ArrivalSchedule(RecordingWorkload(_Steps()), "psychic")


# --- the command ----------------------------------------------------------------------------------------------------


def test_cli_writes_the_json_shape_in_seconds(tmp_path, capsys) -> None:
    out = tmp_path / "fe.json"
    t0 = time.perf_counter()
    code = main(
        [
            "forecast-eval",
            *("--workload", "profile:coding", "--engines", "2", "--batch-size", "6", "--steps", "1"),
            *(
                "--training-s",
                "5",
                "--duration",
                "120",
                "--predictors",
                "naive,ewma,lifecycle",
                "--horizon",
                "7",
            ),
            *("--all-horizons", "--json", str(out)),
        ]
    )
    assert code == 0
    assert time.perf_counter() - t0 < 60.0
    data = json.loads(out.read_text())
    assert data["horizon_s"] == 7.0
    assert list(data["predictors"]) == ["naive", "ewma", "lifecycle"]
    printed = capsys.readouterr().out
    for name, row in data["predictors"].items():
        # every figure the table prints, coverage80 included
        assert {"prefill_wape", "decode_wape", "coverage90", "coverage80"} <= set(row)
        assert {"prefill_wape_vs_naive", "decode_wape_vs_naive", "prefill_wape_vs_arima"} <= set(row)
        assert row["prefill_wape_vs_arima"] is None  # arima not evaluated: JSON null, table "-"
        assert row["prefill_wape_vs_naive"] == pytest.approx(
            row["prefill_wape"] / data["predictors"]["naive"]["prefill_wape"]
        )
        assert isinstance(row["forecasts"], int)
        assert all(isinstance(row[k], float) for k in ("prefill_wape", "decode_wape", "coverage80"))
        assert f"{row['coverage80']:.3f}" in printed and name in printed
    assert set(data["horizons"]) == {"5", "7", "10", "30"}
    assert data["run"]["trajectories_completed"] == data["run"]["tracker_finished"]
    assert data["run"]["scored_until_s"] <= 120.0
    assert "lifecycle" in printed and "horizon 30 s" in printed


def test_cli_reports_bad_input(capsys) -> None:
    assert main(["forecast-eval", "--workload", "nope"]) == 2
    assert main(["forecast-eval", "--workload", "profile:coding", "--predictors", "crystal-ball"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "crystal-ball" in err

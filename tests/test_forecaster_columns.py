"""The forecaster's columnar path (observe_columns) gives the same pictures and forecasts as the object path
(observe_snapshot); every predictor's forecast encodes on the wire (no numpy scalars reach a proto message)."""

from __future__ import annotations

import numpy as np
import pytest

import proto
from prorsa.bench.synthetic import SyntheticWorkload, generate_events
from proto import DemandForecast, LifecycleSnapshot, TrajectoryFeatures
from services.forecaster.core import ForecasterCore
from services.forecaster.picture import PendingArrival, build_picture, build_picture_columns
from services.trajectory_tracker.core import TrackerCore

HORIZONS = (5.0, 10.0, 30.0)
# Small models (fewer simulated paths; no ETS or ARIMA inside the ensemble: their fits take seconds): these tests compare
# and encode, they do not score accuracy. Refits run every 10 s of the stream.
OPTIONS = {
    "lifecycle": {"paths": 128},
    "ensemble": {
        "members": ("naive", "ewma", "lifecycle"),
        "member_options": {"lifecycle": {"paths": 128}},
    },
}
REFIT = {
    "lifecycle",
    "ensemble",
    "ets",
}  # ARIMA is not refitted here (its unfitted forecasts still go on the wire)


def _core(predictor: str) -> ForecasterCore:
    return ForecasterCore(predictor, horizons_s=HORIZONS, predictor_options=OPTIONS.get(predictor, {}))


def _run(
    predictors: tuple[str, ...], seconds: int, pending_every: int = 0
) -> tuple[list[DemandForecast], list[DemandForecast]]:
    """Two cores per predictor fed the same stream, one through snapshots and one through columns; refits every
    10 s. Returns the forecasts of (snapshot cores, column cores), in the same order."""
    tracker = TrackerCore()
    by_obj = [_core(p) for p in predictors]
    by_col = [_core(p) for p in predictors]
    events = generate_events(SyntheticWorkload(trajectories=60, arrival_spread_s=10.0, seed=11))
    out_obj: list[DemandForecast] = []
    out_col: list[DemandForecast] = []
    tick = 1
    for t, ev in events:
        while t >= tick and tick <= seconds:
            cols = tracker.columns(float(tick))
            snap = tracker.snapshot(float(tick))
            hints: tuple[PendingArrival, ...] = ()
            if pending_every and tick % pending_every == 0 and cols.n:
                named = str(cols.traj_ids[0])
                hints = (
                    PendingArrival(at_s=tick + 2.0, prompt_tokens=900, traj_id=named, task="math"),
                    PendingArrival(at_s=tick + 4.0, prompt_tokens=700, task="coding"),
                )
            for a, b in zip(by_obj, by_col, strict=True):
                a.observe_snapshot(snap, pending=hints)
                b.observe_columns(cols, pending=hints)
                if tick % 10 == 0:
                    a.refit(float(tick))
                    b.refit(float(tick))
                out_obj.append(a.forecast(float(tick)))
                out_col.append(b.forecast(float(tick)))
            tick += 1
        tracker.apply(ev, t)
        for core in (*by_obj, *by_col):
            core.observe_event(ev, t)
    return out_obj, out_col


def _quantiles(fc: DemandForecast) -> np.ndarray:
    return np.array(
        [
            [
                getattr(getattr(h, m), q)
                for m in proto.HorizonForecast.__struct_fields__[1:]
                for q in ("q10", "q50", "q90")
            ]
            for h in fc.horizons
        ]
    )


def test_columns_and_snapshots_give_the_same_forecasts() -> None:
    a, b = _run(("lifecycle", "ensemble"), seconds=32, pending_every=3)
    assert len(a) == len(b) == 64
    assert any(_quantiles(f).sum() > 0 for f in a)
    for x, y in zip(a, b, strict=True):
        assert x.ts_s == y.ts_s and x.snapshot_ts_s == y.snapshot_ts_s and x.predictor == y.predictor
        np.testing.assert_allclose(_quantiles(x), _quantiles(y), rtol=1e-9, atol=1e-9)


def test_the_two_pictures_are_equal() -> None:
    tracker = TrackerCore()
    events = generate_events(SyntheticWorkload(trajectories=40, arrival_spread_s=5.0, seed=4))
    for t, ev in events[: len(events) // 3]:
        tracker.apply(ev, t)
    now = events[len(events) // 3][0]
    cols = tracker.columns(now)
    pa, pb = build_picture(tracker.snapshot(now)), build_picture_columns(cols)
    assert pa.n == pb.n > 10 and pa.task_names == pb.task_names and pa.ts_s == pb.ts_s
    for field in ("task", "state", "time_in_state_s", "generated", "context", "turn"):
        x, y = getattr(pa, field), getattr(pb, field)
        assert x.dtype == y.dtype and np.array_equal(x, y), field
    assert pa.traj_ids == pb.traj_ids
    assert (pa.decode_concurrency, pa.kv_tokens) == (pb.decode_concurrency, pb.kv_tokens)


def test_columns_with_unknown_states_and_unlisted_tasks() -> None:
    """Rows in a state the picture does not model are left out; task codes are renumbered by first appearance
    among the rows kept, so a task with no live trajectory is not listed."""
    from services.trajectory_tracker.columns import SnapshotColumns

    cols = SnapshotColumns(
        ts_s=5.0,
        seq=1,
        state_names=("queued", "prefill", "decode", "tool_call", "mystery"),
        task_names=("gone", "b", "a"),
        traj_ids=np.array(["x", "y", "z", "w"], dtype=object),
        task=np.array([2, 1, 0, 2], dtype=np.int32),
        state=np.array([2, 3, 4, 0], dtype=np.int8),
        time_in_state_s=np.array([1.0, 2.0, 3.0, 4.0]),
        turn=np.array([1, 2, 3, 0]),
        context_tokens=np.array([10, 20, 30, 40]),
        generated_this_turn=np.array([5, 0, 0, 0]),
        policy_version=np.zeros(4, dtype=np.int64),
        silent=np.zeros(4, dtype=bool),
        tool=np.array(["", "", "", ""], dtype=object),
        counts={"decode": 1},
        counts_by_task={},
        context_tokens_by_state={"decode": 10},
    )
    pic = build_picture_columns(cols)
    assert pic.task_names == ("a", "b") and pic.task.tolist() == [0, 1, 0]
    assert pic.state.tolist() == [2, 3, 0] and pic.traj_ids == ["x", "y", "w"]
    assert pic.time_in_state_s.tolist() == [1.0, 2.0, 4.0] and pic.turn.tolist() == [1, 2, 0]
    assert not pic.rejected


@pytest.mark.parametrize("predictor", ["naive", "ewma", "ets", "arima", "lifecycle", "ensemble"])
def test_every_predictors_forecast_encodes(predictor: str) -> None:
    """numpy scalars (numpy.float64) reach no proto message: msgspec cannot encode them."""
    tracker = TrackerCore()
    core = _core(predictor)
    events = generate_events(SyntheticWorkload(trajectories=40, arrival_spread_s=10.0, seed=2))
    tick, encoded = 1.0, 0
    for t, ev in events:
        while t >= tick:
            core.observe_snapshot(tracker.snapshot(tick), np.float64(tick))  # a numpy `now` too
            if predictor in REFIT and tick % 10 == 0:
                core.refit(tick)
            fc = core.forecast(np.float64(tick))
            assert proto.decode_as(proto.encode(fc), DemandForecast) == fc
            encoded += 1
            tick += 1.0
        tracker.apply(ev, t)
        core.observe_event(ev, t)
    assert encoded > 25  # past the ensemble's conformal start (20 matured) and the series models' fits


def test_a_wire_snapshot_with_a_numpy_timestamp_round_trips() -> None:
    snap = LifecycleSnapshot(
        ts_s=3.0,
        seq=1,
        counts={"decode": 1},
        counts_by_task={},
        context_tokens_by_state={"decode": 5},
        trajectories=[
            TrajectoryFeatures(
                traj_id="a",
                task="t",
                state="decode",
                time_in_state_s=1.0,
                turn=0,
                context_tokens=5,
                generated_this_turn=1,
            )
        ],
    )
    core = ForecasterCore("lifecycle", horizons_s=HORIZONS)
    core.observe_snapshot(snap)
    fc = core.forecast(np.float64(3.0))
    assert type(fc.ts_s) is float and type(fc.horizons[0].decode_tokens.q50) is float
    proto.encode(fc)

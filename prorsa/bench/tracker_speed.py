"""Speed of the tracker and forecaster cores: `python -m prorsa.bench.tracker_speed [--live 10000]`.

Targets (issue 4): the tracker core applies >= 50,000 events/s on one core; a snapshot plus a forecast
(lifecycle, and prorsa) for 10,000 live trajectories takes <= 20 ms at p99. Refits are not timed (they run off
the event loop); everything else a live snapshot tick does is.

Two paths are timed: "columns" (in process: `TrackerCore.columns` -> `ForecasterCore.observe_columns`, what the
target is about) and "objects" (`TrackerCore.snapshot` -> `ForecasterCore.observe_snapshot`, the wire message's
per-trajectory objects, which the tracker and forecaster services exchange today; encoding is not timed).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from prorsa.bench.synthetic import SyntheticWorkload, generate_events
from proto import (
    PrefillDone,
    ProgressItem,
    RequestFinished,
    TokenProgress,
    ToolCallStarted,
    TrajectoryStarted,
    TurnSubmitted,
)
from services.forecaster.core import ForecasterCore
from services.trajectory_tracker.core import TrackerCore


def bench_events(trajectories: int) -> tuple[int, float]:
    """(events, seconds) to apply a synthetic stream of `trajectories` trajectories."""
    events = generate_events(SyntheticWorkload(trajectories=trajectories, arrival_spread_s=60.0, seed=1))
    core = TrackerCore()
    t0 = time.perf_counter()
    for t, ev in events:
        core.apply(ev, t)
    dt = time.perf_counter() - t0
    assert core.live_count == 0 and not core.rejections, (core.live_count, core.rejections)
    return len(events), dt


def populate(core: TrackerCore, live: int, now: float, rng: np.random.Generator) -> None:
    """`live` trajectories spread over the four live states (30 % decode, 40 % tool call, 20 % prefill, 10 %
    queued), two tasks, various turns and progress."""
    for i in range(live):
        tid, task, turn = f"L{i}", ("coding", "math")[i % 2], int(rng.integers(0, 30))
        t = now - float(rng.uniform(0.0, 20.0))
        core.apply(TrajectoryStarted(traj_id=tid, ts_s=t, task=task, prompt_tokens=2000), t)
        u = rng.random()
        if u < 0.1:
            continue
        rid = f"{tid}:{turn}"
        prompt = 2000 + 400 * turn
        core.apply(TurnSubmitted(traj_id=tid, ts_s=t, turn=turn, request_id=rid, prompt_tokens=prompt), t)
        if u < 0.3:
            continue
        core.apply(
            PrefillDone(
                engine_id="p",
                ts_s=t,
                request_id=rid,
                traj_id=tid,
                turn=turn,
                new_tokens=200,
                cached_tokens=prompt - 200,
            ),
            t,
        )
        g = int(rng.integers(1, 600))
        core.apply(
            TokenProgress(
                engine_id="d",
                ts_s=t,
                items=[ProgressItem(request_id=rid, traj_id=tid, turn=turn, output_tokens=g)],
            ),
            t,
        )
        if u < 0.6:
            continue
        core.apply(
            RequestFinished(
                engine_id="d",
                ts_s=t,
                request_id=rid,
                traj_id=tid,
                turn=turn,
                prompt_tokens=prompt,
                cached_tokens=prompt - 200,
                output_tokens=g,
            ),
            t,
        )
        core.apply(ToolCallStarted(traj_id=tid, ts_s=t, turn=turn, tool="bash"), t)


def warm_forecaster(predictor: str) -> ForecasterCore:
    """A forecaster that has learned distributions and 90 s of series from a synthetic run, and refitted."""
    fc = ForecasterCore(predictor, refit_interval_s=1e9, predictor_options=_options(predictor))
    tracker = TrackerCore()
    events = generate_events(SyntheticWorkload(trajectories=400, arrival_spread_s=60.0, seed=2))
    next_snap = 1.0
    for t, ev in events:
        while t >= next_snap:
            fc.observe_snapshot(tracker.snapshot(next_snap))
            next_snap += 1.0
        tracker.apply(ev, t)
        fc.observe_event(ev, t)
    fc.refit(next_snap)
    return fc


def _options(predictor: str) -> dict:
    return (
        {"member_options": {"ets": {"fit_points": 120}, "arima": {"fit_points": 120}}}
        if predictor == "ensemble"
        else {}
    )


def bench_tick(predictor: str, live: int, ticks: int, columns: bool = True) -> dict[str, np.ndarray]:
    """Milliseconds per tick with `live` live trajectories: "snapshot" (TrackerCore.columns, or .snapshot),
    "observe" (ForecasterCore.observe_columns, or .observe_snapshot), "forecast" (ForecasterCore.forecast) and
    their "total"."""
    fc = warm_forecaster(predictor)
    now = fc.last_snapshot_ts_s + 1.0
    tracker = TrackerCore()
    populate(tracker, live, now, np.random.default_rng(3))
    take = tracker.columns if columns else tracker.snapshot
    observe = fc.observe_columns if columns else fc.observe_snapshot
    out = {k: np.zeros(ticks) for k in ("snapshot", "observe", "forecast", "total")}
    for i in range(ticks):
        now += 1.0
        t0 = time.perf_counter()
        snap = take(now)
        t1 = time.perf_counter()
        observe(snap)  # type: ignore[operator]
        t2 = time.perf_counter()
        fc.forecast(now)
        t3 = time.perf_counter()
        for k, dt in (("snapshot", t1 - t0), ("observe", t2 - t1), ("forecast", t3 - t2), ("total", t3 - t0)):
            out[k][i] = dt * 1e3
    return out


def _pct(ms: np.ndarray) -> str:
    return f"p50 {np.percentile(ms, 50):.1f} ms, p99 {np.percentile(ms, 99):.1f} ms, max {ms.max():.1f} ms"


def main(argv: list[str] | None = None, report: Callable[[str], None] = print) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trajectories", type=int, default=2000, help="trajectories in the event-rate run")
    p.add_argument("--live", type=int, default=10_000, help="live trajectories in the snapshot+forecast run")
    p.add_argument("--ticks", type=int, default=200, help="snapshot+forecast ticks timed per predictor")
    p.add_argument("--no-objects", action="store_true", help="skip the object (wire-form) path")
    args = p.parse_args(argv)
    n, dt = bench_events(args.trajectories)
    figures = {"tracker_events_per_s": n / dt}
    report(f"tracker core: {n} events in {dt:.2f} s = {n / dt:,.0f} events/s (target >= 50,000)")
    paths = (("columns", True),) if args.no_objects else (("columns", True), ("objects", False))
    for path, columns in paths:
        for name in ("lifecycle", "ensemble"):
            ms = bench_tick(name, args.live, args.ticks, columns)
            key = name if columns else f"{name}_objects"
            figures[f"{key}_tick_p50_ms"] = float(np.percentile(ms["total"], 50))
            figures[f"{key}_tick_p99_ms"] = float(np.percentile(ms["total"], 99))
            target = " (target p99 <= 20 ms)" if columns else ""
            report(f"{path}: snapshot + {name} forecast, {args.live} live: {_pct(ms['total'])}{target}")
            parts = ", ".join(
                f"{k} {np.percentile(ms[k], 50):.1f}" for k in ("snapshot", "observe", "forecast")
            )
            report(f"  p50 by phase (ms): {parts}")
    return figures


if __name__ == "__main__":
    main()

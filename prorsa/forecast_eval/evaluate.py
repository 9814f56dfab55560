"""One simulation, every demand predictor forecasting it live, every forecast scored against what happened.

The loop (all in virtual time, driven by the simulator's events through its observer hook):
  1. every simulator event goes through `SimBridge` (proto messages, queued) and the `ArrivalSchedule` (hints);
  2. at each tick t = k * window_s, once the bridge is `ready(t)`: the messages up to t are applied to a
     `TrackerCore` and every forecaster core (`observe_event`), with each decoding request's progress at t
     interpolated between its reports (see bridge.py); then `tracker.expire(t)`, `tracker.snapshot(t)`, and each
     core's `observe_snapshot(snapshot, t, pending=<hints>)` and forecast for every horizon; refits run inline
     when a core says one is due;
  3. after the run, the realised demand over (t, t+h] comes from the bridge's `DemandLedger` (exact, same event
     stream) and each predictor is scored (`scoring.py`), skipping forecasts whose horizon ends after the run.
Tick t sees exactly the events at or before t: the forecast for (t, t+h] never contains an event it is scored on.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prorsa.forecast_eval.bank import PREDICTORS, SCORED_METRICS, ForecastBank
from prorsa.forecast_eval.bridge import SimBridge
from prorsa.forecast_eval.hints import ArrivalSchedule, RecordingWorkload
from prorsa.forecast_eval.scoring import score
from prorsa.forecast_eval.split import split_workload
from prorsa.sim.runner import SimConfig, SimResult, run_simulation
from services.forecaster.base import Predictor
from services.forecaster.lifecycle_model import PriorSamples
from services.trajectory_tracker.core import BENIGN_KINDS, TrackerCore

# Interpolated progress is stamped this much before the tick, so the forecaster's series puts it in the window
# that the tick closes (windows are [k W, (k+1) W); a flow at exactly the tick would open the next one).
_BEFORE_TICK_S = 1e-6


@dataclass(frozen=True)
class EvalOptions:
    horizons_s: tuple[float, ...] = (5.0, 10.0, 30.0)
    predictors: tuple[str, ...] = PREDICTORS
    window_s: float = 1.0  # series window = tick interval (s)
    refit_interval_s: float = 30.0
    hints: str = "started"  # see hints.py: none | started | schedule
    seed: int = 0  # forecaster seed (the lifecycle model's Monte Carlo)
    split: str = "all"  # the half of the workload's instances evaluated (split.py): all | dev | report
    # what `lifecycle` (standalone and in the ensemble) starts a new workload from (None: the round PRIORS);
    # loto.py passes the other traces' samples
    prior: PriorSamples | None = None


@dataclass
class EvalResult:
    config: SimConfig
    options: EvalOptions
    sim: SimResult
    ticks_s: np.ndarray  # (T,)
    forecasts: dict[str, np.ndarray]  # name -> (T, horizons, 2 metrics, q10/q50/q90)
    actual: np.ndarray  # (T, horizons, 2 metrics): realised prefill and decode tokens over (t, t+h]
    valid: np.ndarray  # (T, horizons): the horizon ends within the run
    scored_until_s: float
    scores: dict[str, list[dict[str, float]]]  # name -> one row per horizon (scoring.score)
    # (T, horizons, 2 metrics): the physically possible demand every forecast was kept within
    bound: np.ndarray
    tracker: TrackerCore
    bridge: SimBridge
    bad_rejections: dict[str, int]  # tracker rejections other than duplicate/stale/late (should be none)
    refits: int
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self, horizon_s: float) -> dict[str, dict[str, float]]:
        """name -> every figure the table prints at `horizon_s` (one of the options' horizons): WAPEs, their
        ratios to naive's and arima's (when those were evaluated), coverage90 and coverage80 (pooled and per
        metric), and the number of forecasts scored."""
        j = self.options.horizons_s.index(float(horizon_s))
        rows = {name: dict(scores[j]) for name, scores in self.scores.items()}
        for row in rows.values():
            for ref in ("naive", "arima"):
                for m in ("prefill", "decode"):
                    den = rows[ref][f"{m}_wape"] if ref in rows else math.nan
                    row[f"{m}_wape_vs_{ref}"] = row[f"{m}_wape"] / den if den and den == den else math.nan
        return rows

    def bound_exceeded(self) -> dict[str, float]:
        """How often the realised demand exceeded the demand bound (services/forecaster/bounds.py), over the scored
        (tick, horizon) pairs, per scored metric: the share, and the largest realised / bound."""
        out: dict[str, float] = {}
        for i, m in enumerate(SCORED_METRICS):
            a, b = self.actual[..., i][self.valid], self.bound[..., i][self.valid]
            name = m.removesuffix("_tokens")
            out[f"{name}_share"] = float(np.mean(a > b * (1 + 1e-9))) if a.size else math.nan
            ratio = a / np.maximum(b, 1e-9)
            out[f"{name}_max_ratio"] = float(ratio.max()) if a.size else math.nan
        return out

    def to_json(self, horizon_s: float) -> dict[str, Any]:
        m = self.sim.sim.metrics
        data = {
            "horizon_s": horizon_s,
            "predictors": self.summary(horizon_s),
            "horizons": {
                f"{h:g}": {name: rows[j] for name, rows in self.scores.items()}
                for j, h in enumerate(self.options.horizons_s)
            },
            "run": {
                "config": self.config.echo(),
                "split": self.options.split,
                "hints": self.options.hints,
                "prior": "other traces" if self.options.prior is not None else "round stand-ins",
                "window_s": self.options.window_s,
                "refit_interval_s": self.options.refit_interval_s,
                "end_s": self.sim.end_s,
                "scored_until_s": self.scored_until_s,
                "ticks": int(len(self.ticks_s)),
                "trajectories_completed": m.trajectories_completed,
                "tracker_finished": self.tracker.totals["finished"],
                "tracker_bad_rejections": self.bad_rejections,
                "prefill_tokens": self.bridge.ledger.prefill_total_tokens,
                "decode_tokens": self.bridge.ledger.decode_total_tokens,
                "refits": self.refits,
                "bound_exceeded": self.bound_exceeded(),
                **self.extra,
                "wall_s": self.wall_s,
            },
        }
        return _json_safe(data)


class _Evaluator:
    """The simulator observer that runs the ticks (module header, steps 1-2)."""

    def __init__(
        self,
        bank: ForecastBank,
        schedule: ArrivalSchedule,
        window_s: float,
        on_tick: Callable[[float, int], None] | None,
    ) -> None:
        self.bridge = SimBridge()
        self.tracker = TrackerCore()
        self.bank = bank
        self.schedule = schedule
        self.window_s = window_s
        self.on_tick = on_tick
        self._k = 0
        self.next_tick_s = 0.0
        self.ticks: list[float] = []
        self.rows: dict[str, list[np.ndarray]] = {name: [] for name in bank.names}
        self._step_of: dict[str, int] = {}
        self.bad_rejections: dict[str, int] = {}

    def on_event(self, kind: str, traj_id: str, now: float, **f: Any) -> None:
        self.bridge.on_event(kind, traj_id, now, **f)
        if kind == "trajectory_started":
            self._step_of[traj_id] = int(f["step"])
            self.schedule.started(int(f["step"]), traj_id, int(f.get("attempt", 0)), now)
        elif kind == "trajectory_finished":
            self.schedule.finished(self._step_of.pop(traj_id, 0), now)
        while self.next_tick_s < now and self.bridge.ready(self.next_tick_s):
            self._tick(self.next_tick_s)

    def finish(self, end_s: float) -> None:
        """Ticks up to the end of the run (no event will come to unblock them any more)."""
        while self.next_tick_s <= end_s + 1e-9:
            self._tick(self.next_tick_s)

    def _apply(self, msg: Any, t: float) -> None:
        for r in self.tracker.apply(msg, t):
            if r.kind not in BENIGN_KINDS:
                self.bad_rejections[r.kind] = self.bad_rejections.get(r.kind, 0) + 1
        self.bank.observe_event(msg, t)

    def _tick(self, t: float) -> None:
        for ts, msg in self.bridge.flush(t, _BEFORE_TICK_S):
            self._apply(msg, ts)
        self.tracker.expire(t)
        forecasts = self.bank.tick(self.tracker.snapshot(t), t, self.schedule.pending(t))
        for name, fc in forecasts.items():
            self.rows[name].append(fc)
        self.ticks.append(t)
        self._k += 1
        self.next_tick_s = self._k * self.window_s
        if self.on_tick is not None:
            self.on_tick(t, self.tracker.totals["finished"])


def _load(config: SimConfig, split: str = "all") -> RecordingWorkload:
    if isinstance(config.workload, str):
        inner = split_workload(
            config.workload,
            split,
            batch_size=config.batch_size,
            group_size=config.group_size,
            seed=config.seed,
        )
        return RecordingWorkload(inner)
    if split != "all":
        raise ValueError("a split applies to a workload spec, not to a workload object")
    return RecordingWorkload(config.workload)


def run_forecast_eval(
    config: SimConfig,
    options: EvalOptions | None = None,
    extra_predictors: dict[str, Predictor] | None = None,
    on_tick: Callable[[float, int], None] | None = None,
) -> EvalResult:
    """Simulate `config` (its observer is replaced) and score every predictor (see the module header).

    `extra_predictors`: predictor instances to score alongside, by name. `on_tick(t, finished)`: called after
    each tick with its virtual time and the trajectories finished so far. Raises what `run_simulation` raises
    on a bad configuration (ValueError, WorkloadError, PolicyError)."""
    opts = options or EvalOptions()
    workload = _load(config, opts.split)
    schedule = ArrivalSchedule(
        workload, opts.hints, sync=config.mode == "sync", training_s=config.training_s, steps=config.steps
    )
    bank = ForecastBank(
        opts.predictors,
        opts.horizons_s,
        opts.window_s,
        opts.refit_interval_s,
        opts.seed,
        extra_predictors,
        prior=opts.prior,
    )
    ev = _Evaluator(bank, schedule, opts.window_s, on_tick)
    t0 = time.perf_counter()
    sim = run_simulation(dataclasses.replace(config, workload=workload, observer=ev))
    ev.finish(sim.end_s)
    open_since = ev.bridge.open_since_s()
    until = sim.end_s if open_since is None else min(sim.end_s, open_since)
    ticks = np.array(ev.ticks)
    hs = np.array(opts.horizons_s)
    actual = np.stack(
        [np.stack([ev.bridge.ledger.realised(m, ticks, h) for m in SCORED_METRICS], axis=-1) for h in hs],
        axis=1,
    )
    valid = ticks[:, None] + hs[None, :] <= until + 1e-9
    forecasts = {name: np.array(rows) for name, rows in ev.rows.items()}
    scores = {name: score(fc, actual, valid, SCORED_METRICS) for name, fc in forecasts.items()}
    return EvalResult(
        config=config,
        options=opts,
        sim=sim,
        ticks_s=ticks,
        forecasts=forecasts,
        actual=actual,
        valid=valid,
        scored_until_s=until,
        scores=scores,
        bound=np.array(bank.bounds),
        tracker=ev.tracker,
        bridge=ev.bridge,
        bad_rejections=ev.bad_rejections,
        refits=bank.refits,
        wall_s=time.perf_counter() - t0,
        extra={"refit_s": bank.refit_s, "forecast_s": bank.forecast_s},
    )


def horizons_with(horizon_s: float, base: Sequence[float] = (5.0, 10.0, 30.0)) -> tuple[float, ...]:
    """`base` plus `horizon_s`, sorted (the horizon a table is printed for is always evaluated)."""
    return tuple(sorted({float(h) for h in base} | {float(horizon_s)}))


def _json_safe(x: Any) -> Any:
    """NaN/inf -> None, numpy scalars -> Python (JSON has no NaN)."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x

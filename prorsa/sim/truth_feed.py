"""A forecasting policy fed the true future demand (`--forecaster truth`), run as passes over the same config.

This measures what a perfect *forecast* is worth to a policy (the bench's "value of the forecast"); the limit of
what any *policy* can do is the hindsight search, `prorsa.sim.hindsight` (policy `oracle`).

The future demand depends on the decisions (a different split moves every later turn), so no single run can be fed
its own future. Passes:
  1. run the policy (with the `lifecycle` forecaster's live feed) and record the demand that really happened
     (`DemandRecord`: new prompt tokens at submission, output tokens spread over each decode report interval — the
     `DemandLedger` definitions — decoding sequences over time, and the KV they hold at each decision);
  k. (k >= 2) run the policy with `ClusterView.forecast` built from pass k-1's record: for each decision at t and
     horizon h, the realised prefill and decode tokens over (t, t+h], the mean decoding sequences over (t, t+h] and
     the KV at t+h, with q10 = q50 = q90 = truth (`TruthForecast`); and the demand outlook (`truth_outlook.py`):
     this pass's live trajectories by phase and starts (the present, as the tracker would report it), and pass
     k-1's turns, tool calls and finishes over the outlook's horizon (the shortest);
stopping after 3 passes, or as soon as a truth-fed pass's rollout_s is not shorter than the pass before it. The
result is the truth-fed pass with the shortest rollout_s (then the lowest average trajectory time): choosing the
best pass is fair, since any of them is a run of the same policy on the truth of a nearby run. Each pass is deterministic, so `run_truth_fed` is too. A user's
`config.observer` sees only the returned pass: it is run once more with the observer attached (same inputs, so
the same run).

Truth between grid points: the cumulative demand functions are evaluated on a grid of `min(1 s, interval_s)` and
interpolated; decisions fall on multiples of the policy interval, so in practice every query is on the grid and
exact. A query past the recorded run's end sees no demand (that run had none left).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from prorsa.forecast_eval.ledger import DemandLedger
from prorsa.sim.forecast_feed import ForecastFeed, decoded_at, live_feed
from prorsa.sim.runner import SimConfig, SimResult, _load_workload, simulate
from prorsa.sim.truth_outlook import LivePhases, TurnRecord, TurnTruth
from proto import DemandForecast, HorizonForecast, Quantiles
from services.allocator.registry import make_policy
from services.forecaster.series import HORIZONS_S

if TYPE_CHECKING:
    from prorsa.sim.engine import SimEngine

MAX_PASSES = 3
_ENDS = frozenset({"tool_call_start", "trajectory_finished", "request_migrated", "trajectory_aborted"})


class DemandRecord:
    """A `SimObserver` recording the realised demand of one run (see the module header); `sample` at decisions."""

    def __init__(self) -> None:
        self.ledger = DemandLedger()
        self._last: dict[
            tuple[str, int], tuple[float, int]
        ] = {}  # decoding request -> (last report s, tokens)
        self._dead: set[tuple[str, int]] = set()  # aborted attempts: their last partial decode is not demand
        self._conc_t: list[float] = [0.0]  # times the number of decoding sequences changed
        self._conc_n: list[int] = [0]  # the number from that time on
        self.kv_t: list[float] = []  # decision times
        self.kv_tokens: list[float] = []  # context tokens held by decoding sequences at each decision
        self.present = LivePhases()  # this run's live trajectories by phase, and its starts
        self.turns = TurnRecord()  # this run's turns, tool calls and finishes: the next pass's outlook

    def on_event(self, kind: str, traj_id: str, now: float, **f: Any) -> None:
        key = (traj_id, int(f.get("attempt", 0)))
        if key in self._dead:
            return
        self.present.on_event(kind, traj_id, key[1], f)
        self.turns.on_event(kind, traj_id, now, key[1], f)
        if kind == "turn_submitted":
            self.ledger.add_prefill(now, int(f["new_tokens"]))
        elif kind == "decode_started":
            if key not in self._last:
                self._count(now, +1)
            self._last[key] = (now, 0)  # tokens count from 0 on each engine (a migrated decode restarts)
        elif kind == "decode_progress":
            last = self._last.get(key)
            tokens = int(f["tokens"])
            if last is not None and tokens > last[1]:
                self.ledger.add_decode(last[0], now, tokens - last[1])
                self._last[key] = (now, tokens)
        elif kind in _ENDS:
            if self._last.pop(key, None) is not None:
                self._count(now, -1)
            if kind == "trajectory_aborted":
                self._dead.add(key)

    def _count(self, now: float, delta: int) -> None:
        n = self._conc_n[-1] + delta
        if self._conc_t[-1] == now:
            self._conc_n[-1] = n
        else:
            self._conc_t.append(now)
            self._conc_n.append(n)

    def sample(self, now: float, engines: Iterable[SimEngine]) -> None:
        """Record the KV held by decoding sequences at `now` (read from the engines' state)."""
        kv = 0
        for e in engines:
            for req in e.seqs.values():
                kv += req.context_tokens + decoded_at(e, req, now)
        self.kv_t.append(now)
        self.kv_tokens.append(float(kv))

    def truth(self, end_s: float, grid_s: float, horizons_s: tuple[float, ...] = HORIZONS_S) -> TruthForecast:
        """The recorded run's demand, frozen for queries (`end_s`: when that run ended)."""
        step = min(1.0, grid_s)
        grid = np.arange(0.0, end_s + max(horizons_s) + 2 * step, step)
        t, n = np.array(self._conc_t), np.array(self._conc_n, dtype=np.float64)
        # ∫ n dt up to each change point, then interpolated (exact: n is constant between change points).
        area = np.concatenate(([0.0], np.cumsum(n[:-1] * np.diff(t))))
        cum_conc = np.interp(
            grid, np.concatenate((t, [end_s])), np.concatenate((area, [area[-1] + n[-1] * (end_s - t[-1])]))
        )
        return TruthForecast(
            grid_s=grid,
            prefill=self.ledger.cumulative("prefill_tokens", grid),
            decode=self.ledger.cumulative("decode_tokens", grid),
            concurrency=cum_conc,
            kv_t=np.array(self.kv_t),
            kv=np.array(self.kv_tokens),
            end_s=end_s,
            horizons_s=tuple(horizons_s),
            turns=self.turns.freeze(),
        )


@dataclasses.dataclass(frozen=True)
class TruthForecast:
    """Cumulative demand of a recorded run on a time grid; `forecast(now)` is its future seen from `now`."""

    grid_s: np.ndarray
    prefill: np.ndarray  # new prompt tokens submitted by each grid time (inclusive)
    decode: np.ndarray  # output tokens generated by each grid time
    concurrency: np.ndarray  # ∫ decoding sequences dt up to each grid time (sequence-seconds)
    kv_t: np.ndarray  # decision times of the recorded run
    kv: np.ndarray  # KV tokens of decoding sequences at those times
    end_s: float
    horizons_s: tuple[float, ...]
    turns: TurnTruth | None = None  # the recorded run's turns, for the outlook (None: no outlook)

    def forecast(self, now: float, present: LivePhases | None = None) -> DemandForecast:
        """The recorded run's demand over each horizon from `now`, and with `present` (the running pass's live
        trajectories) the outlook over the shortest horizon."""
        horizons = []
        for h in self.horizons_s:
            a, b = np.interp([now, now + h], self.grid_s, self.prefill)
            c, d = np.interp([now, now + h], self.grid_s, self.decode)
            e, f = np.interp([now, now + h], self.grid_s, self.concurrency)
            horizons.append(
                HorizonForecast(
                    horizon_s=h,
                    prefill_tokens=_exact(b - a),
                    decode_tokens=_exact(d - c),
                    decode_concurrency=_exact((f - e) / h),
                    kv_tokens=_exact(self._kv_at(now + h)),
                )
            )
        if present is None or self.turns is None:
            return DemandForecast(
                ts_s=float(now), predictor="truth", horizons=horizons, snapshot_ts_s=float(now)
            )
        h = min(self.horizons_s)
        return DemandForecast(
            ts_s=float(now),
            predictor="truth",
            horizons=horizons,
            snapshot_ts_s=float(now),
            outlook=self.turns.outlook(now, h, present),
            outlook_horizon_s=h,
            started_total=present.started_total,
        )

    def _kv_at(self, t: float) -> float:
        if t > self.end_s or not len(self.kv_t):
            return 0.0
        i = int(np.searchsorted(self.kv_t, t + 1e-9, side="right")) - 1
        return float(self.kv[i]) if i >= 0 else 0.0


def _exact(value: float) -> Quantiles:
    v = max(0.0, float(value))
    return Quantiles(q10=v, q50=v, q90=v)


class _PassFeed:
    """One pass's feed: records this run (`DemandRecord`) and answers decisions from the live forecaster (pass 1)
    or from the previous pass's truth."""

    def __init__(
        self, record: DemandRecord, live: ForecastFeed | None = None, truth: TruthForecast | None = None
    ) -> None:
        self.record, self.live, self.truth = record, live, truth

    def on_event(self, kind: str, traj_id: str, now: float, **f: Any) -> None:
        self.record.on_event(kind, traj_id, now, **f)
        if self.live is not None:
            self.live.on_event(kind, traj_id, now, **f)

    def at(self, now: float, engines: Iterable[SimEngine]) -> DemandForecast | None:
        engines = list(engines)
        self.record.sample(now, engines)
        if self.live is not None:
            return self.live.at(now, engines)
        return self.truth.forecast(now, self.record.present) if self.truth is not None else None


FIRST_PASS_FORECASTER = "lifecycle"


def first_pass(config: SimConfig) -> tuple[SimResult, DemandRecord]:
    """Pass 1: `config` with its live forecast feed, recorded. The recording only watches, so the result is
    exactly `run_simulation(config)`'s."""
    profile = config.model_profile()
    policy = make_policy(config.policy, config.engines, profile=profile)
    if not policy.uses_forecast:
        raise ValueError(f"a truth-fed run needs a forecasting policy, not {config.policy!r}")
    record = DemandRecord()
    recorded, live = live_feed(config, _load_workload(config))
    return simulate(config, policy, profile, recorded, feed=_PassFeed(record, live=live)), record


def run_truth_fed(config: SimConfig) -> SimResult:
    """Run `config` (a forecasting policy, `forecaster="truth"`) as the module header's passes; returns the best
    truth-fed pass, with every pass's figures under the JSON key `truth_passes`. Raises what `run_simulation`
    raises on a bad configuration."""
    profile = config.model_profile()
    workload = _load_workload(config)
    spec = config.policy
    quiet = dataclasses.replace(config, observer=None, forecaster=FIRST_PASS_FORECASTER)
    first = first_pass(quiet)
    result, record = first
    passes = [_figures(1, spec, result)]
    truth_runs: list[tuple[SimResult, TruthForecast]] = []
    for k in range(2, MAX_PASSES + 1):
        truth = record.truth(result.end_s, result.sim.policy.interval_s)
        record = DemandRecord()
        policy = make_policy(config.policy, config.engines, profile=profile)
        result = simulate(quiet, policy, profile, workload, feed=_PassFeed(record, truth=truth))
        truth_runs.append((result, truth))
        passes.append(_figures(k, config.policy, result))
        if result.end_s >= passes[-2]["rollout_s"]:
            break  # no longer improving
    best_i = min(
        range(len(truth_runs)),
        key=lambda i: (truth_runs[i][0].end_s, truth_runs[i][0].sim.metrics.completion.mean()),
    )
    best, best_truth = truth_runs[best_i]
    if config.observer is not None:  # the user's observer sees the chosen pass (module header)
        policy = make_policy(config.policy, config.engines, profile=profile)
        best = simulate(config, policy, profile, workload, feed=_PassFeed(DemandRecord(), truth=best_truth))
    best.config = config
    best.extra["truth_passes"] = {"passes": passes, "chosen_pass": best_i + 2}
    return best


def _figures(k: int, spec: str, result: SimResult) -> dict[str, Any]:
    m = result.sim.metrics
    return {
        "pass": k,
        "policy": spec,
        "rollout_s": result.end_s,
        "avg_trajectory_s": m.completion.mean(),
        "role_switches": m.role_switches,
    }

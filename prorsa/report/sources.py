"""Turn what the commands already produce into `RunData`: the simulator's JSON (`SimResult.to_json(timelines=True)`)
and a live rollout's `LiveResult` (its recorder and completion times)."""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

from prorsa.report.model import Forecasts, RunData, Windows

if TYPE_CHECKING:
    from prorsa.rollout.live import LiveResult
    from proto import DemandForecast, EngineStats


def from_sim_json(name: str, result: dict[str, Any]) -> RunData:
    """One simulation's JSON; without its `timelines` section the roles, forecasts and times stay empty."""
    w = result["windows"]
    windows = Windows(
        window_s=float(w["window_s"]),
        t_s=list(w["t_s"]),
        prefill_demand=list(w["prefill_demand_tokens_per_s"]),
        prefill_computed=list(w["prefill_computed_tokens_per_s"]),
        decode=list(w["decode_tokens_per_s"]),
        prefill_capacity=list(w["capacity_prefill_tokens_per_s"]),
        decode_capacity=list(w["capacity_decode_tokens_per_s"]),
        mixed_prefill_capacity=list(w["capacity_mixed_prefill_tokens_per_s"]),
        mixed_decode_capacity=list(w["capacity_mixed_decode_tokens_per_s"]),
    )
    tl = result.get("timelines", {})
    roles = {e: [(float(t), str(r)) for t, r in changes] for e, changes in tl.get("engine_roles", {}).items()}
    rows = tl.get("forecasts", [])
    forecasts = _forecasts([(r[0], r[1], r[2:5], r[5:8]) for r in rows]) if rows else None
    return RunData(
        name=name,
        summary=result,
        end_s=float(tl.get("end_s", result.get("rollout_s", 0.0))),
        roles=roles,
        windows=windows,
        forecasts=forecasts,
        trajectory_s=[(float(v), int(n)) for v, n in tl.get("trajectory_s_buckets", [])],
        forecast_note="" if forecasts else f"policy {result['config']['policy']!r} reads no demand forecast",
    )


def from_live(name: str, result: LiveResult, profile: str | None = None) -> RunData:
    """One live rollout. `profile`: the simulated engines' performance profile, for the capacity lines (None for
    real engines, whose capacity the recording does not know)."""
    rec = result.recorder
    stats = sorted(rec.stats, key=lambda s: s.ts_s)
    stamps = [s.ts_s for s in stats] + [t.ts_s for t in rec.turns]
    if not stamps:
        return RunData(name=name, summary=result.summary, trajectory_s=_exact(result.trajectory_s))
    t0, t1 = min(stamps), max(stamps)
    roles: dict[str, list[tuple[float, str]]] = {}
    for engine_id, changes in rec.role_timeline().items():
        roles[engine_id] = [(t - t0, role) for t, role in changes]
    windows = _live_windows(result, t0, t1, profile)
    forecasts = _forecasts(
        [
            (f.ts_s - t0, h.horizon_s, _q(h.prefill_tokens), _q(h.decode_tokens))
            for f, h in _first(rec.forecasts)
        ]
    )
    return RunData(
        name=name,
        summary=result.summary,
        end_s=t1 - t0,
        roles=roles,
        windows=windows,
        forecasts=forecasts,
        trajectory_s=_exact(result.trajectory_s),
        forecast_note="" if forecasts else "no forecast was published during the run",
    )


def from_error(name: str, error: str) -> RunData:
    return RunData(name=name, summary={}, error=error)


def _first(forecasts: list[DemandForecast]) -> list[tuple[DemandForecast, Any]]:
    return [(f, f.horizons[0]) for f in sorted(forecasts, key=lambda f: f.ts_s) if f.horizons]


def _q(q: Any) -> tuple[float, float, float]:
    return (q.q10, q.q50, q.q90)


def _forecasts(rows: list[tuple[float, float, Any, Any]]) -> Forecasts | None:
    """(t_s, horizon_s, prefill q10/q50/q90 tokens, decode ...) → rates; None when there are none."""
    rows = [r for r in rows if r[1] > 0]
    if not rows:
        return None

    def rates(i: int, k: int) -> list[float]:
        return [r[i][k] / r[1] for r in rows]

    return Forecasts(
        t_s=[r[0] for r in rows],
        horizon_s=[r[1] for r in rows],
        prefill=(rates(2, 0), rates(2, 1), rates(2, 2)),
        decode=(rates(3, 0), rates(3, 1), rates(3, 2)),
    )


def _exact(durations: list[float]) -> list[tuple[float, int]]:
    return sorted(Counter(durations).items())


def _live_windows(result: LiveResult, t0: float, t1: float, profile: str | None) -> Windows:
    """Windows of about 1/80 of the run, and at least two stats intervals wide (so every engine reports in each):
    demand from the submitted turns, computed and decoded tokens from each engine's stats (its rates averaged over
    the window, summed over engines), capacity from the engines' roles (the last reported role carried over a
    window without a report) and the profile."""
    rec = result.recorder
    window_s = max(1.0, (t1 - t0) / 80, 2 * _stats_interval_s(rec.stats))
    n = max(1, math.ceil((t1 - t0) / window_s + 1e-9))
    demand = [0.0] * n
    for turn in rec.turns:
        demand[min(n - 1, int((turn.ts_s - t0) / window_s))] += turn.new_tokens / window_s
    # engine → window → samples of (prefill rate, decode rate, role)
    samples: dict[str, dict[int, list[tuple[float, float, str]]]] = {}
    for s in rec.stats:
        i = min(n - 1, int((s.ts_s - t0) / window_s))
        samples.setdefault(s.engine_id, {}).setdefault(i, []).append(
            (s.prefill_tokens_per_s, s.decode_tokens_per_s, s.role)
        )
    computed, decode = [0.0] * n, [0.0] * n
    engines: dict[str, list[float]] = {r: [0.0] * n for r in ("prefill", "decode", "mixed")}
    for per_window in samples.values():
        last_role = None
        for i in range(min(per_window), n):
            rows = per_window.get(i)
            if rows is None:  # no report in this window: the engine is still there, in its last role
                engines[last_role][i] += 1.0
                continue
            computed[i] += sum(r[0] for r in rows) / len(rows)
            decode[i] += sum(r[1] for r in rows) / len(rows)
            for r in rows:
                engines[r[2]][i] += 1 / len(rows)
            last_role = rows[-1][2]
    capacity: dict[str, list[float] | None] = dict.fromkeys(("p", "d", "mp", "md"))
    if profile:
        from services.runtime import perf_model as pm
        from services.runtime.model_profiles import load_profile

        p = load_profile(profile)
        pre, dec = p.prefill_tokens_per_s, pm.decode_tokens_per_s_nominal(p)
        capacity = {
            "p": [x * pre for x in engines["prefill"]],
            "d": [x * dec for x in engines["decode"]],
            "mp": [x * pre for x in engines["mixed"]],
            "md": [x * dec for x in engines["mixed"]],
        }
    return Windows(
        window_s=window_s,
        t_s=[i * window_s for i in range(n)],
        prefill_demand=demand,
        prefill_computed=computed,
        decode=decode,
        prefill_capacity=capacity["p"],
        decode_capacity=capacity["d"],
        mixed_prefill_capacity=capacity["mp"],
        mixed_decode_capacity=capacity["md"],
    )


def _stats_interval_s(stats: list[EngineStats]) -> float:
    """The median time between two reports of one engine (0 with fewer than two)."""
    last: dict[str, float] = {}
    gaps = []
    for s in sorted(stats, key=lambda s: s.ts_s):
        if s.engine_id in last:
            gaps.append(s.ts_s - last[s.engine_id])
        last[s.engine_id] = s.ts_s
    return sorted(gaps)[len(gaps) // 2] if gaps else 0.0

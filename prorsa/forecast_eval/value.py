"""What a predictor is worth to the allocator: the same run planned on its forecasts, on naive's, and on the truth.

WAPE says how close a forecast is; the user is judged on trajectory and rollout time. So for one configuration
and one allocator policy spec (default `prorsa`; whatever the spec is, it is run as given), each predictor gets a
simulated run of its own — `SimConfig(policy=POLICY, forecaster=NAME)` with the live forecast feed
(`prorsa.sim.forecast_feed`) — and the truth gets the truth-fed passes (`prorsa.sim.truth_feed`): the
`naive` run is recorded (`DemandRecord`), the same policy is run again fed that record's realised demand
(`TruthForecast`: q10 = q50 = q90 = what happened), up to `MAX_PASSES` times while rollout time improves, and
the best pass is the truth row (a run fed the true future of a nearby run, as `--forecaster truth` does).
Capture = (naive - predictor) / (naive - truth), per figure: the share of the truth's gain over naive that the
predictor delivers (None when the truth gains nothing). Every run is deterministic, so the table is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from prorsa.sim.runner import SimConfig, SimResult, _load_workload, run_simulation, simulate
from prorsa.sim.truth_feed import MAX_PASSES, DemandRecord, _PassFeed, first_pass
from services.allocator.registry import make_policy

TRUTH = "truth"


def _figures(result: SimResult) -> dict[str, float]:
    m = result.sim.metrics
    return {
        "avg_trajectory_s": float(m.completion.mean()),
        "rollout_s": float(result.end_s),
        "role_switches": int(m.role_switches),
    }


def predictor_value(
    config: SimConfig, predictors: Sequence[str], policy: str = "prorsa"
) -> dict[str, dict[str, Any]]:
    """name -> figures of the run planned on that predictor, plus `naive` and `truth` (module header), each with
    `capture_*`. Raises ValueError when `policy` reads no forecast (nothing to compare), and what
    `run_simulation` raises on a bad configuration."""
    base = dataclasses.replace(config, policy=policy, observer=None, workload=_load_workload(config))
    profile = base.model_profile()
    naive_run, record = first_pass(dataclasses.replace(base, forecaster="naive"))
    rows: dict[str, dict[str, Any]] = {"naive": _figures(naive_run)}
    for name in predictors:
        if name not in rows:
            rows[name] = _figures(run_simulation(dataclasses.replace(base, forecaster=name)))
    rows[TRUTH] = _truth(base, profile, naive_run, record)
    for row in rows.values():
        for key in ("avg_trajectory_s", "rollout_s"):
            gain = rows["naive"][key] - rows[TRUTH][key]
            row[f"capture_{key}"] = (rows["naive"][key] - row[key]) / gain if gain > 1e-9 else None
    return rows


def _truth(base: SimConfig, profile: Any, run: SimResult, record: DemandRecord) -> dict[str, Any]:
    best: dict[str, Any] | None = None
    last_rollout = run.end_s
    for k in range(2, MAX_PASSES + 1):
        truth = record.truth(run.end_s, run.sim.policy.interval_s)
        record = DemandRecord()
        policy = make_policy(base.policy, base.engines, profile=profile)
        run = simulate(base, policy, profile, base.workload, feed=_PassFeed(record, truth=truth))  # type: ignore[arg-type]
        fig = {**_figures(run), "pass": k}
        if best is None or (fig["rollout_s"], fig["avg_trajectory_s"]) < (
            best["rollout_s"],
            best["avg_trajectory_s"],
        ):
            best = fig
        if run.end_s >= last_rollout:
            break  # no longer improving
        last_rollout = run.end_s
    assert best is not None
    return best

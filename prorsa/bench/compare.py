"""Every allocator policy on the same workload, profile and seed, in one run (so comparisons are ratios from one
run). `static:best` sweeps every P:D split of the fleet and keeps the one with the lowest average trajectory time.
`oracle` is the hindsight search (`prorsa.sim.hindsight`); `POLICY@FORECASTER` runs a forecasting policy with
another predictor (`prorsa@naive`, `prorsa@truth`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from prorsa.sim.runner import SimConfig, run_simulation

RESULT_KEYS = (
    "avg_trajectory_s",
    "p50_trajectory_s",
    "p99_trajectory_s",
    "rollout_s",
    "tokens_per_s",
    "role_switches",
    "prefix_cache_hit_rate",
    "trajectories_completed",
    "trajectories_expected",
)


def expand_policies(specs: list[str], engines: int) -> list[str]:
    """The simulations to run: `static:best` becomes every static:P:D split (P, D ≥ 1)."""
    out: list[str] = []
    for spec in specs:
        if spec == "static:best":
            out += [
                f"static:{p}:{engines - p}"
                for p in range(1, engines)
                if f"static:{p}:{engines - p}" not in out
            ]
        elif spec not in out:
            out.append(spec)
    return out


def compare_policies(
    base: SimConfig,
    specs: list[str],
    progress: Callable[[str], None] | None = None,
    pool: Executor | None = None,
) -> tuple[list[dict[str, Any]], dict[str, dict]]:
    """Run every policy; returns (result rows in the order asked, full JSON per simulated policy).

    A policy that cannot run on this configuration gets a row with an `error` instead of figures. `static:best`
    gets the row of the best static split, named in `chosen`. With a `pool` (processes: each run is a pure
    function of its config) the simulations run in parallel and `progress` hears of each as it ends.
    """
    expanded = expand_policies(specs, base.engines)
    configs = [dataclasses.replace(base, policy=spec) for spec in expanded]
    if pool is None:
        outcomes = []
        for config in configs:
            if progress is not None:
                progress(config.policy)
            outcomes.append(run_spec(config))
    else:
        futures = [pool.submit(run_spec, config) for config in configs]
        outcomes = []
        for config, future in zip(configs, futures, strict=True):
            outcomes.append(future.result())
            if progress is not None:
                progress(f"{config.policy} done")
    return assemble(specs, dict(zip(expanded, outcomes, strict=True)))


def run_spec(config: SimConfig) -> dict[str, Any] | str:
    """One policy's full JSON, or the reason it cannot run on this configuration (a module-level function, so a
    process pool can run it)."""
    try:
        return _run(config)
    except ValueError as exc:  # PolicyError and WorkloadError are ValueErrors
        return str(exc)


def assemble(
    specs: list[str], outcomes: dict[str, dict[str, Any] | str]
) -> tuple[list[dict[str, Any]], dict[str, dict]]:
    """`compare_policies`' result from each expanded spec's outcome (`run_spec`)."""
    full = {k: v for k, v in outcomes.items() if isinstance(v, dict)}
    errors = {k: v for k, v in outcomes.items() if isinstance(v, str)}
    rows: list[dict[str, Any]] = []
    for spec in specs:
        if spec == "static:best":
            statics = {k: v for k, v in full.items() if k.startswith("static:")}
            if not statics:
                rows.append({"policy": spec, "error": "no static split could run"})
                continue
            chosen = min(statics, key=lambda k: statics[k]["avg_trajectory_s"])
            rows.append({"policy": spec, "chosen": chosen, **_figures(statics[chosen])})
        elif spec in errors:
            rows.append({"policy": spec, "error": errors[spec]})
        else:
            rows.append({"policy": spec, **_figures(full[spec])})
    return rows, full


def _run(config: SimConfig) -> dict[str, Any]:
    """One policy's JSON. A spec `POLICY@FORECASTER` runs POLICY with that forecaster (`truth`: fed the true
    future demand), so the value of a forecast is a ratio from one run."""
    policy, _, forecaster = config.policy.partition("@")
    if forecaster:
        config = dataclasses.replace(config, policy=policy, forecaster=forecaster)
    return run_simulation(config).to_json(timelines=True)


def _figures(result: dict[str, Any]) -> dict[str, Any]:
    """The row of one simulation: RESULT_KEYS, plus `switches` (the name the bench JSON promises), plus the hit
    rate by tier where the engines have a host KV tier."""
    tiers = {k: result[k] for k in ("prefix_cache_hit_rate_by_tier",) if k in result}
    return {**{k: result[k] for k in RESULT_KEYS}, "switches": result["role_switches"], **tiers}


def speedups(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """policy → colocated avg trajectory time / its own (None where either could not run)."""
    colocated = next((r for r in rows if r["policy"] == "colocated" and "error" not in r), None)
    out: dict[str, float | None] = {}
    for r in rows:
        ok = colocated is not None and "error" not in r and r["avg_trajectory_s"] > 0
        out[r["policy"]] = colocated["avg_trajectory_s"] / r["avg_trajectory_s"] if ok else None
    return out

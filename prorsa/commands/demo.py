"""`prorsa demo` (the README's main job): a short live comparison of `colocated`, the best fixed prefill/decode
split and `prorsa` on the embedded default — embedded nats-server, every service, simulated engines at a
speed-up — printing the rows and prorsa's ratio to each. Every figure comes from the run itself.

The fixed split is chosen by the simulator in the same run: it runs the same workload, profile and seed under every
split P:D first (seconds), and the live rollout uses the one with the least average trajectory time — the strongest
fixed choice a user could have made knowing the workload. The simulator's rows stand beside the live ones, so the
live system is checked against the model it is built on: at a high speed-up the live rows run somewhat slower,
because every wall-clock millisecond of the bus path becomes `speedup` milliseconds of workload time
(docs/benchmarks.md, "Live vs simulated"). With real engines the split is chosen on the profile they report (the
simulator's figures for it are not printed: they are a model of those engines, not a measurement)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from prorsa.commands import rollout

BASELINE = "colocated"
OURS = "prorsa"
# The default setting is one where the split matters: a prefill-heavy agent (long observations, short replies) on
# DP-attention engines, whose mixed steps stall every rank's decode behind one rank's prefill. There the best fixed
# split runs ~1.3x faster than colocation (docs/benchmarks.md, "The demo's setting"), in about two minutes live.
DEMO_SIM_PROFILE = "deepseek-v3.2"


def add_arguments(p: argparse.ArgumentParser) -> None:
    rollout.add_arguments(p)
    p.set_defaults(
        workload="profile:general",
        engines=4,
        batch_size=16,
        steps=1,
        speedup=10.0,
        training_s=20.0,
        report="out",
    )


def sim_profile(args: argparse.Namespace) -> str:
    """The profile the simulator models: the simulated engines' own, or what real engines report."""
    if args.backend == "sim":
        return args.profile or DEMO_SIM_PROFILE
    return args.profile or rollout.default_vllm_profile() or "qwen3-235b"


def static_splits(engines: int) -> list[str]:
    """Every fixed split with at least one engine per role."""
    return [f"static:{p}:{engines - p}" for p in range(1, engines)]


def best_static(sims: dict[str, dict[str, Any]]) -> str:
    """The fixed split with the least average trajectory time (ties: the first, fewest prefill engines)."""
    statics = {k: v for k, v in sims.items() if k.startswith("static:")}
    return min(statics, key=lambda k: statics[k]["avg_trajectory_s"])


def simulated(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """The simulator's figures for the same rollout (same profile, workload and seed)."""
    from prorsa.sim import SimConfig, run_simulation

    config = SimConfig(
        workload=args.workload,
        profile=sim_profile(args),
        engines=args.engines,
        policy=policy,
        mode=args.mode,
        staleness=args.staleness,
        steps=args.steps,
        batch_size=args.batch_size,
        group_size=args.group_size,
        training_s=args.training_s,
        seed=args.seed,
    )
    return run_simulation(config).to_json(timelines=True)


def run(args: argparse.Namespace) -> int:
    from prorsa.console import table_console
    from prorsa.rollout.report import summary_table

    console = table_console()
    if args.backend == "sim" and not args.profile:
        args.profile = DEMO_SIM_PROFILE  # the live engines run the profile the simulator models
    with console.status("simulator: choosing the best fixed split"):
        sims = {p: simulated(args, p) for p in (BASELINE, *static_splits(args.engines), OURS)}
    static = best_static(sims) if args.engines > 1 else None
    policies = [BASELINE, *([static] if static else []), OURS]
    console.print(
        f"best fixed split in the simulator: {static} "
        f"({sims[static]['avg_trajectory_s']:.1f} s average trajectory)"
        if static
        else "one engine: no split"
    )
    results = {
        policy: rollout.run_with_progress(rollout.live_config(args, policy), f"{args.workload} · {policy}")
        for policy in policies
    }
    live = {policy: result.summary for policy, result in results.items()}
    sim = {p: sims[p] for p in policies} if args.backend == "sim" else {}
    columns = {**live, **{f"sim {p}": r for p, r in sim.items()}}
    title = (
        f"prorsa demo · {args.workload} · {args.engines} × {args.backend} engines "
        f"· {args.batch_size} trajectories · {args.mode}"
    )
    console.print(summary_table(columns, title))
    for label, rows in (("live", live), ("simulated", sim)):
        if not rows:
            continue
        ours = rows[OURS]
        for other in policies[:-1]:
            ratios = [
                f"{key} {rows[other][key] / ours[key]:.2f}×"
                for key in ("avg_trajectory_s", "rollout_s")
                if ours[key] > 0
            ]
            console.print(f"{label}: {other} / prorsa = {', '.join(ratios)}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(
                {
                    "static": static,
                    "live": live,
                    "simulated": {p: _headline(r) for p, r in sim.items()},
                    "simulated_splits": {p: _headline(r) for p, r in sims.items()},
                },
                f,
                indent=1,
            )
    if args.report:
        _report(console, args, title, results, sim)
    complete = all(r["trajectories_completed"] == r["trajectories_expected"] for r in live.values())
    return 0 if complete else 1


def _headline(sim_json: dict[str, Any]) -> dict[str, Any]:
    """The simulator's scalar results (its time series stay out of the demo's JSON)."""
    return {k: v for k, v in sim_json.items() if isinstance(v, int | float | str)}


def _report(console: Any, args: argparse.Namespace, title: str, results: dict, sim: dict) -> None:
    """The live runs, then the simulator's rows beside them."""
    from prorsa.commands import reporting
    from prorsa.report import from_sim_json

    runs = reporting.live_runs(results, sim_profile(args) if args.backend == "sim" else None)
    runs += [from_sim_json(f"sim {p}", r) for p, r in sim.items()]
    reporting.write(console, args.report, "demo.html", title, runs, [f"speed-up {args.speedup:g}×"])

"""`prorsa demo` (the README's main job): a short live comparison of `colocated` vs `prorsa` on the embedded
default — embedded nats-server, every service, simulated engines at a speed-up, the `swe` workload — printing both
rows and their ratio. Every figure comes from the run itself. With simulated engines, the discrete-event simulator
runs the same workload, profile and policies beside it (seconds), so the live system is checked against the model
it is built on: at a high speed-up the live rows run somewhat slower, because every wall-clock millisecond of the
bus path becomes `speedup` milliseconds of workload time (docs/benchmarks.md, "Live vs simulated")."""

from __future__ import annotations

import argparse
import json
from typing import Any

from prorsa.commands import rollout

POLICIES = ("colocated", "prorsa")


def add_arguments(p: argparse.ArgumentParser) -> None:
    rollout.add_arguments(p)
    p.set_defaults(
        workload="swe", engines=4, batch_size=8, steps=1, speedup=20.0, training_s=20.0, report="out"
    )


def simulated(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """The simulator's figures for the same rollout (simulated engines only: same profile, workload and seed)."""
    from prorsa.sim import SimConfig, run_simulation

    config = SimConfig(
        workload=args.workload,
        profile=args.profile or "qwen3-235b",
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
    from rich.console import Console

    from prorsa.rollout.report import summary_table

    console = Console()
    results = {
        policy: rollout.run_with_progress(rollout.live_config(args, policy), f"{args.workload} · {policy}")
        for policy in POLICIES
    }
    live = {policy: result.summary for policy, result in results.items()}
    sim = {p: simulated(args, p) for p in POLICIES} if args.backend == "sim" else {}
    columns = {**live, **{f"sim {p}": r for p, r in sim.items()}}
    title = (
        f"prorsa demo · {args.workload} · {args.engines} × {args.backend} engines "
        f"· {args.batch_size} trajectories · {args.mode}"
    )
    console.print(summary_table(columns, title))
    for label, rows in (("live", live), ("simulated", sim)):
        if not rows:
            continue
        base, ours = rows["colocated"], rows["prorsa"]
        ratios = [
            f"{key} {base[key] / ours[key]:.2f}×"
            for key in ("avg_trajectory_s", "rollout_s")
            if ours[key] > 0
        ]
        console.print(f"{label}: colocated / prorsa = {', '.join(ratios)}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"live": live, "simulated": {p: _headline(r) for p, r in sim.items()}}, f, indent=1)
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

    runs = reporting.live_runs(results, (args.profile or "qwen3-235b") if args.backend == "sim" else None)
    runs += [from_sim_json(f"sim {p}", r) for p, r in sim.items()]
    reporting.write(console, args.report, "demo.html", title, runs, [f"speed-up {args.speedup:g}×"])

"""`prorsa demo` (the README's main job): a short live comparison of `colocated` vs `prorsa` on the embedded
default — embedded nats-server, every service, simulated engines at a speed-up, the `swe` workload — printing both
rows and their ratio. Every figure comes from the run itself."""

from __future__ import annotations

import argparse

from prorsa.commands import rollout

POLICIES = ("colocated", "prorsa")


def add_arguments(p: argparse.ArgumentParser) -> None:
    rollout.add_arguments(p)
    p.set_defaults(workload="swe", engines=4, batch_size=8, steps=1, speedup=40.0, training_s=20.0)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from prorsa.rollout.report import summary_table

    console = Console()
    rows = {}
    for policy in POLICIES:
        result = rollout.run_with_progress(rollout.live_config(args, policy), f"{args.workload} · {policy}")
        rows[policy] = result.summary
    console.print(
        summary_table(
            rows,
            f"prorsa demo · {args.workload} · {args.engines} × {args.backend} engines "
            f"· {args.batch_size} trajectories · {args.mode}",
        )
    )
    base, ours = rows["colocated"], rows["prorsa"]
    for key in ("avg_trajectory_s", "rollout_s"):
        if ours[key] > 0:
            console.print(f"{key}: colocated / prorsa = {base[key] / ours[key]:.2f}×")
    complete = all(r["trajectories_completed"] == r["trajectories_expected"] for r in rows.values())
    return 0 if complete else 1

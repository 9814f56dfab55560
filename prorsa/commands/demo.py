"""`prorsa demo` (the README's main job): a short live comparison of `colocated` vs `prorsa` on the embedded
default — embedded nats-server, every service, simulated engines at a speed-up — printing both rows and their
ratio. Every figure comes from the run itself.

Defaults: the `general` task profile (long tool observations, many turns: prefill-heavy multi-turn work) on four
`deepseek-v3.2`-like engines (DP attention, where a colocated engine's prompt chunks stall every rank's decode) —
the setting where the simulator says the split matters (`prorsa sim` on the same settings: colocated 162.5 s vs
prorsa 130.2 s average trajectory time). `--workload swe --profile qwen3-235b` shows the opposite case: there
colocation wastes little and prorsa keeps every engine mixed."""

from __future__ import annotations

import argparse

from prorsa.commands import rollout

POLICIES = ("colocated", "prorsa")


def add_arguments(p: argparse.ArgumentParser) -> None:
    rollout.add_arguments(p)
    p.set_defaults(
        workload="profile:general",
        profile="deepseek-v3.2",
        engines=4,
        batch_size=16,
        steps=1,
        speedup=40.0,
        training_s=20.0,
    )


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

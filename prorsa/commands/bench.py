"""`prorsa bench`: every allocator policy on the same workload and seed, in one run; a table, JSON and plots."""

from __future__ import annotations

import argparse
import json
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    from prorsa.sim.cli import add_sim_arguments

    add_sim_arguments(p)
    p.add_argument(
        "--policies",
        default="colocated,static:best,reactive,dynamo,prorsa,oracle",
        help="comma-separated policy specs; static:best sweeps every P:D split",
    )
    p.add_argument("--plot-dir", default=None, help="write one demand-vs-capacity plot per policy here")
    p.add_argument("--report", metavar="DIR", default=None, help="write a self-contained HTML report here")


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from prorsa.bench.compare import compare_policies, speedups
    from prorsa.console import table_console
    from prorsa.sim.cli import config_from_args

    console = table_console()
    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    try:
        base = config_from_args(args)
    except ValueError as exc:
        print(f"prorsa bench: {exc}")
        return 2
    with console.status("simulating…") as status:
        rows, full = compare_policies(base, specs, lambda spec: status.update(f"simulating {spec}…"))
    table = Table(
        title=f"prorsa bench · {args.workload} · {args.profile} · {args.engines} engines · {args.mode}"
        + (f" (staleness {args.staleness})" if args.mode == "async" else "")
    )
    for col in ("policy", "avg traj (s)", "p99 traj (s)", "rollout (s)", "switches", "vs colocated (avg)"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    ratios = speedups(rows)
    for r in rows:
        name = r["policy"] + (f" → {r['chosen']}" if "chosen" in r else "")
        if "error" in r:
            table.add_row(name, "-", "-", "-", "-", f"[red]{r['error'][:60]}[/red]")
            continue
        ratio = "-" if ratios[r["policy"]] is None else f"{ratios[r['policy']]:.2f}×"
        table.add_row(
            name,
            f"{r['avg_trajectory_s']:.1f}",
            f"{r['p99_trajectory_s']:.1f}",
            f"{r['rollout_s']:.1f}",
            str(r["role_switches"]),
            ratio,
        )
    console.print(table)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"config": base.echo(), "results": rows}, f, indent=1)
        console.print(f"wrote {args.json_path}")
    if args.plot_dir:
        from prorsa.sim.plot import plot_windows

        os.makedirs(args.plot_dir, exist_ok=True)
        for spec, data in full.items():
            if spec.startswith("static:") and not any(
                r.get("chosen") == spec or r["policy"] == spec for r in rows
            ):
                continue  # the sweep's other splits: only the chosen one is plotted
            path = os.path.join(args.plot_dir, f"bench-{spec.replace(':', '_')}.png")
            plot_windows(data, path)
        console.print(f"plots in {args.plot_dir}")
    if args.report:
        from prorsa.commands.reporting import bench_report

        bench_report(console, args.report, table.title, rows, full, base.echo())
    return 0 if all("error" not in r for r in rows) else 1

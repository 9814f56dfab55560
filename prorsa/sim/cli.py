"""`prorsa sim`: run one simulation, print a table, optionally write the JSON result and a plot.

Cheap to import (the main CLI builds every subcommand's parser): the simulator, rich and matplotlib load in
`run_sim_command`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from prorsa.sim.sim_driver import MODES
from services.allocator.switch_coordinator import DRAIN_TIMEOUT_S

if TYPE_CHECKING:
    from rich.table import Table

    from prorsa.sim.runner import SimConfig, SimResult


def add_run_arguments(
    parser: argparse.ArgumentParser, *, workload: str = "profile:coding", steps: int | None = None
) -> None:
    """Add the options of one simulated run (what `config_from_args` reads) to `parser`, with the default
    `workload` and `steps` of the command. `prorsa sim` and `prorsa forecast-eval` share them."""
    parser.add_argument(
        "--workload", default=workload, help="workload spec (e.g. swe, trace:PATH, profile:math)"
    )
    parser.add_argument("--profile", default="qwen3-235b", help="model profile name or profile JSON path")
    parser.add_argument("--engines", type=int, default=8, help="number of engines (serving instances)")
    parser.add_argument("--mode", choices=MODES, default="sync", help="RL mode")
    parser.add_argument(
        "--staleness", type=int, default=1, help="async: max policy versions a trajectory may lag"
    )
    parser.add_argument("--policy", default="colocated", help="allocator policy: colocated, static:P:D, ...")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload, simulator and forecasters")
    parser.add_argument("--steps", type=int, default=steps, help="RL steps (batches) to train")
    parser.add_argument("--duration", type=float, default=None, metavar="SECONDS", help="cap on virtual time")
    parser.add_argument("--batch-size", type=int, default=64, help="trajectories per step")
    parser.add_argument("--group-size", type=int, default=1, help="trajectories per GRPO group")
    parser.add_argument("--training-s", type=float, default=60.0, help="trainer seconds per batch")
    parser.add_argument(
        "--drain-bound-s", type=float, default=DRAIN_TIMEOUT_S, help="switching: keep decodes ending within"
    )
    parser.add_argument(
        "--forecaster",
        default="prorsa",
        help="demand predictor fed to policies that plan on forecasts (prorsa): naive, ewma, ets, arima, "
        "lifecycle, prorsa, or truth (the true future demand, run as passes: prorsa.sim.truth_feed)",
    )
    parser.add_argument(
        "--host-kv-ratio",
        type=float,
        default=0.0,
        metavar="RATIO",
        help="give each engine a host-memory KV tier of RATIO x its device KV, reloaded over PCIe instead of "
        "recomputed (SGLang's --hicache-ratio; 2 is HiCache's default; services.runtime.host_kv); "
        "0 = none (default: %(default)s)",
    )


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `prorsa sim` options to `parser`."""
    add_run_arguments(parser)
    parser.add_argument("--json", dest="json_path", metavar="FILE", help="write the result as JSON")
    parser.add_argument(
        "--plot", dest="plot_path", metavar="FILE", help="plot demand vs capacity (PNG, PDF, SVG)"
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The `SimConfig` of the options `add_run_arguments` added. Raises ValueError on an invalid one."""
    from prorsa.sim.runner import SimConfig

    return SimConfig(
        workload=args.workload,
        profile=args.profile,
        engines=args.engines,
        mode=args.mode,
        staleness=args.staleness,
        training_s=args.training_s,
        policy=args.policy,
        seed=args.seed,
        steps=args.steps,
        duration_s=args.duration,
        batch_size=args.batch_size,
        group_size=args.group_size,
        drain_bound_s=args.drain_bound_s,
        forecaster=args.forecaster,
        host_kv_ratio=args.host_kv_ratio,
    )


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def result_table(result: SimResult, data: dict[str, Any]) -> Table:
    from rich.table import Table

    cfg = data["config"]
    table = Table(
        title=f"prorsa sim · {cfg['workload']} · {cfg['profile']} · {cfg['engines']} × {cfg['policy']}"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        (
            "trajectories completed / expected",
            f"{data['trajectories_completed']} / {data['trajectories_expected']}",
        ),
        ("trajectory time avg (s)", data["avg_trajectory_s"]),
        ("trajectory time p50 (s)", data["p50_trajectory_s"]),
        ("trajectory time p99 (s)", data["p99_trajectory_s"]),
        ("rollout (s)", data["rollout_s"]),
        ("output tokens/s", data["tokens_per_s"]),
        ("prefix-cache hit rate", data["prefix_cache_hit_rate"]),
        *[
            (f"  of it from {tier}", rate)
            for tier, rate in data.get("prefix_cache_hit_rate_by_tier", {}).items()
        ],
        ("role switches", data["role_switches"]),
        ("migrations", data["migrations"]),
        ("trajectories aborted", data["trajectories_aborted"]),
        ("trajectories truncated", data["trajectories_truncated"]),
    ]
    rows += [(f"utilisation {role}", frac) for role, frac in data["utilisation"].items()]
    rows.append(("simulated in (wall s)", result.wall_s))
    for name, value in rows:
        table.add_row(name, _fmt(value))
    return table


def run_sim_command(args: argparse.Namespace) -> int:
    """Run `prorsa sim` with parsed `args`; returns the process exit code (2 on a bad configuration)."""
    from prorsa.console import table_console
    from prorsa.sim.runner import run_simulation
    from prorsa.workload.errors import WorkloadError
    from services.allocator.policy import PolicyError

    console = table_console()
    try:
        config = config_from_args(args)
        with console.status("simulating…"):
            result = run_simulation(config)
    except (ValueError, WorkloadError, PolicyError) as exc:
        print(f"prorsa sim: {exc}", file=sys.stderr)
        return 2
    data = result.to_json()
    console.print(result_table(result, data))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(data, f, indent=1)
        console.print(f"wrote {args.json_path}")
    if args.plot_path:
        from prorsa.sim.plot import plot_windows

        plot_windows(data, args.plot_path)
        console.print(f"wrote {args.plot_path}")
    return 0


# The names the main `prorsa` CLI looks for in a subcommand module.
add_arguments = add_sim_arguments
run = run_sim_command


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (`python -m prorsa.sim.cli`) until the main CLI wires `prorsa sim`."""
    parser = argparse.ArgumentParser(prog="prorsa sim", description=__doc__)
    add_sim_arguments(parser)
    return run_sim_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

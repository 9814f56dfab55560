"""`prorsa forecast-eval`: simulate one workload, let every demand predictor forecast it live, score them.

Prints a table (predictor x prefill WAPE, decode WAPE, coverage) for `--horizon`, or for every evaluated horizon
with `--all-horizons`; `--json FILE` writes `{"horizon_s": H, "predictors": {name: {prefill_wape, decode_wape,
coverage90}}, "horizons": {...every horizon, every score...}, "run": {...}}`. See prorsa/forecast_eval/.

Cheap to import (the main CLI builds every subcommand's parser): the simulator, the forecasters and rich load in
`run`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from prorsa.forecast_eval.bank import PREDICTORS
from prorsa.forecast_eval.hints import HINT_MODES
from prorsa.sim.driver import MODES

if TYPE_CHECKING:
    from rich.table import Table

    from prorsa.forecast_eval.evaluate import EvalResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `prorsa forecast-eval` options to `parser`."""
    parser.add_argument(
        "--workload", default="swe", help="workload spec (swe, trace:PATH, profile:coding, ...)"
    )
    parser.add_argument("--profile", default="qwen3-235b", help="model profile name or profile JSON path")
    parser.add_argument("--engines", type=int, default=8, help="number of engines")
    parser.add_argument("--mode", choices=MODES, default="sync", help="RL mode")
    parser.add_argument(
        "--staleness", type=int, default=1, help="async: max policy versions a trajectory may lag"
    )
    parser.add_argument("--policy", default="colocated", help="allocator policy: colocated, static:P:D, ...")
    parser.add_argument("--steps", type=int, default=1, help="RL steps (batches) to train")
    parser.add_argument("--duration", type=float, default=None, metavar="SECONDS", help="cap on virtual time")
    parser.add_argument("--batch-size", type=int, default=64, help="trajectories per step")
    parser.add_argument("--group-size", type=int, default=1, help="trajectories per GRPO group")
    parser.add_argument("--training-s", type=float, default=60.0, help="trainer seconds per batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload, simulator and forecasters")
    parser.add_argument(
        "--horizon", type=float, default=10.0, help="horizon (s) of the table and JSON summary"
    )
    parser.add_argument(
        "--all-horizons", action="store_true", help="print a table for every evaluated horizon"
    )
    parser.add_argument(
        "--predictors",
        default=",".join(PREDICTORS),
        help=f"comma-separated predictors (default: all of {', '.join(PREDICTORS)})",
    )
    parser.add_argument(
        "--hints",
        choices=HINT_MODES,
        default="started",
        help="upcoming first turns passed to the forecasters (see prorsa/forecast_eval/hints.py)",
    )
    parser.add_argument("--refit-interval", type=float, default=30.0, help="forecaster refit interval (s)")
    parser.add_argument("--json", dest="json_path", metavar="FILE", help="write the scores as JSON")


def _fmt(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.3f}"


def score_table(result: EvalResult, horizon_s: float) -> Table:
    from rich.table import Table

    j = result.options.horizons_s.index(float(horizon_s))
    cfg = result.config
    table = Table(
        title=f"prorsa forecast-eval · {cfg.echo()['workload']} · {cfg.mode} · {cfg.engines} × {cfg.policy} · "
        f"horizon {horizon_s:g} s"
    )
    table.add_column("predictor")
    for name in ("prefill WAPE", "decode WAPE", "coverage90", "coverage80"):
        table.add_column(name, justify="right")
    rows = {name: scores[j] for name, scores in result.scores.items()}
    best = {
        m: min((r[m] for r in rows.values() if r[m] == r[m]), default=None)
        for m in ("prefill_wape", "decode_wape")
    }
    for name, r in rows.items():
        cells = [_fmt(r["prefill_wape"]), _fmt(r["decode_wape"])]
        cells = [f"[bold]{c}[/bold]" if r[m] == best[m] else c for c, m in zip(cells, best, strict=True)]
        table.add_row(name, *cells, _fmt(r["coverage90"]), _fmt(r["coverage80"]))
    n = rows[next(iter(rows))]["forecasts"]
    table.caption = (
        f"{n} forecasts scored (one per {result.options.window_s:g} s, horizon inside the run). coverage90: share of "
        "actuals <= q90 (nominal 0.90); coverage80: share within q10..q90 (nominal 0.80); prefill and decode averaged"
    )
    return table


def run(args: argparse.Namespace) -> int:
    """Run `prorsa forecast-eval`; returns the exit code (2 on a bad configuration)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from prorsa.forecast_eval.evaluate import EvalOptions, horizons_with, run_forecast_eval
    from prorsa.sim.runner import SimConfig
    from prorsa.workload.errors import WorkloadError
    from services.allocator.policy import PolicyError

    console = Console(stderr=True)
    predictors = tuple(p.strip() for p in args.predictors.split(",") if p.strip())
    try:
        config = SimConfig(
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
        )
        if not (args.horizon > 0):
            raise ValueError(f"--horizon must be > 0, got {args.horizon}")
        options = EvalOptions(
            horizons_s=horizons_with(args.horizon),
            predictors=predictors,
            hints=args.hints,
            refit_interval_s=args.refit_interval,
            seed=args.seed,
        )
        total = config.steps * config.batch_size if config.steps else None
        columns = (
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("trajectories · {task.fields[t]:,.0f} s virtual"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("forecasting", total=total, t=0.0)

            def on_tick(t: float, finished: int) -> None:
                progress.update(task, completed=finished, t=t)

            result = run_forecast_eval(config, options, on_tick=on_tick)
    except (ValueError, KeyError, WorkloadError, PolicyError) as exc:
        print(f"prorsa forecast-eval: {exc}", file=sys.stderr)
        return 2
    out = Console()
    for h in options.horizons_s if args.all_horizons else (float(args.horizon),):
        out.print(score_table(result, h))
    data: dict[str, Any] = result.to_json(float(args.horizon))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(data, f, indent=1)
        out.print(f"wrote {args.json_path}")
    return 0

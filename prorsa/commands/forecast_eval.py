"""`prorsa forecast-eval`: simulate one workload, let every demand predictor forecast it live, score them.

Prints a table (predictor x prefill / decode WAPE, their ratio to naive's and arima's, coverage90, coverage80) for
`--horizon`, or for every evaluated horizon with `--all-horizons`; `--split dev|report` evaluates one half of the
workload's instances (prorsa/forecast_eval/split.py); `--value` adds the allocator's average trajectory time and
rollout time planned on each predictor vs naive vs the truth (value.py). `--json FILE` writes `{"horizon_s": H,
"predictors": {name: every figure of the table}, "horizons": {...every horizon, every score...}, "value": {name:
{avg_trajectory_s, rollout_s, role_switches, capture_*}} (with --value), "run": {...}}`. `--leave-one-out` runs
every shipped agent trace (or `--traces`) instead of `--workload`, each forecast with a prior pooled from the others
(prorsa/forecast_eval/loto.py), and prints one table: per left-out trace, WAPE against naive and arima and
coverage80, with the targets each misses; its JSON is `{"horizon_s": H, "traces": {trace: <the JSON above>}}`.
See prorsa/forecast_eval/.

Cheap to import (the main CLI builds every subcommand's parser): the simulator, the forecasters and rich load in
`run`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any

from prorsa.forecast_eval.bank import PREDICTORS
from prorsa.forecast_eval.hints import HINT_MODES
from prorsa.forecast_eval.loto import AGENT_TRACES
from prorsa.forecast_eval.split import SPLITS
from prorsa.sim.cli import add_run_arguments, config_from_args

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.progress import Progress, TaskID
    from rich.table import Table

    from prorsa.forecast_eval.evaluate import EvalOptions, EvalResult
    from prorsa.sim.runner import SimConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `prorsa forecast-eval` options to `parser`."""
    add_run_arguments(parser, workload="swe", steps=1)
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
    parser.add_argument(
        "--split",
        choices=SPLITS,
        default="all",
        help="half of the workload's instances: dev (first half) or report (second half); see split.py",
    )
    parser.add_argument(
        "--value",
        action="store_true",
        help="also simulate the allocator planning on each predictor, on naive and on the truth",
    )
    parser.add_argument("--value-policy", default="prorsa", help="allocator policy spec of the --value runs")
    parser.add_argument(
        "--value-predictors",
        default=None,
        help="comma-separated predictors of the --value runs (default: those of --predictors)",
    )
    parser.add_argument(
        "--leave-one-out",
        action="store_true",
        help="evaluate every trace of --traces instead of --workload, each with a prior pooled from the others "
        "(default: off)",
    )
    parser.add_argument(
        "--traces",
        default=",".join(AGENT_TRACES),
        help=f"comma-separated traces of --leave-one-out (default: {','.join(AGENT_TRACES)})",
    )
    parser.add_argument("--json", dest="json_path", metavar="FILE", help="write the scores as JSON")


def _fmt(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.3f}"


def score_table(result: EvalResult, horizon_s: float) -> Table:
    from rich.table import Table

    cfg = result.config
    split = "" if result.options.split == "all" else f" ({result.options.split} half)"
    table = Table(
        title=f"prorsa forecast-eval · {cfg.echo()['workload']}{split} · {cfg.mode} · {cfg.engines} × "
        f"{cfg.policy} · horizon {horizon_s:g} s"
    )
    table.add_column("predictor")
    for name in ("prefill WAPE", "decode WAPE", "prefill ×naive", "decode ×naive", "prefill ×arima"):
        table.add_column(name, justify="right")
    for name in ("coverage90", "coverage80"):
        table.add_column(name, justify="right")
    rows = result.summary(horizon_s)
    best = {
        m: min((r[m] for r in rows.values() if r[m] == r[m]), default=None)
        for m in ("prefill_wape", "decode_wape")
    }
    for name, r in rows.items():
        cells = [_fmt(r["prefill_wape"]), _fmt(r["decode_wape"])]
        cells = [f"[bold]{c}[/bold]" if r[m] == best[m] else c for c, m in zip(cells, best, strict=True)]
        ratios = [
            _fmt(r[k]) for k in ("prefill_wape_vs_naive", "decode_wape_vs_naive", "prefill_wape_vs_arima")
        ]
        table.add_row(name, *cells, *ratios, _fmt(r["coverage90"]), _fmt(r["coverage80"]))
    n = rows[next(iter(rows))]["forecasts"]
    table.caption = (
        f"{n} forecasts scored (one per {result.options.window_s:g} s, horizon inside the run). coverage90: share of "
        "actuals <= q90 (nominal 0.90); coverage80: share within q10..q90 (nominal 0.80); prefill and decode averaged"
    )
    return table


def loto_table(results: dict[str, EvalResult], horizon_s: float) -> Table:
    """One row per left-out trace and predictor (those other than naive and arima): WAPE against naive and
    arima, coverage80, and the targets missed (prorsa/forecast_eval/loto.py)."""
    from rich.table import Table

    from prorsa.forecast_eval.loto import misses

    first = next(iter(results.values()))
    cfg = first.config
    table = Table(
        title=f"prorsa forecast-eval --leave-one-out · {cfg.mode} · {cfg.engines} × {cfg.policy} · "
        f"horizon {horizon_s:g} s"
    )
    for name in (
        "left out",
        "predictor",
        "prefill WAPE",
        "×naive",
        "×arima",
        "decode WAPE",
        "×naive",
        "×arima",
    ):
        table.add_column(name, justify="left" if name in ("left out", "predictor") else "right")
    table.add_column("coverage80", justify="right")
    table.add_column("targets missed")
    for trace, result in results.items():
        for name, r in result.summary(horizon_s).items():
            if name in ("naive", "arima"):
                continue
            table.add_row(
                trace,
                name,
                _fmt(r["prefill_wape"]),
                _fmt(r["prefill_wape_vs_naive"]),
                _fmt(r["prefill_wape_vs_arima"]),
                _fmt(r["decode_wape"]),
                _fmt(r["decode_wape_vs_naive"]),
                _fmt(r["decode_wape_vs_arima"]),
                _fmt(r["coverage80"]),
                ", ".join(misses(r)) or "none",
            )
    table.caption = (
        "each trace forecast by a forecaster whose prior was pooled from the other traces; targets: prefill <= 0.7x "
        "naive, decode <= 0.9x naive, coverage80 in 0.75-0.85"
    )
    return table


def value_table(rows: dict[str, dict[str, Any]], policy: str) -> Table:
    from rich.table import Table

    table = Table(title=f"allocator value · policy {policy} planned on each predictor")
    table.add_column("forecaster")
    for name in ("avg trajectory s", "rollout s", "role switches", "capture (avg traj)", "capture (rollout)"):
        table.add_column(name, justify="right")
    for name, r in rows.items():
        table.add_row(
            name,
            f"{r['avg_trajectory_s']:.1f}",
            f"{r['rollout_s']:.1f}",
            str(r["role_switches"]),
            _fmt(r["capture_avg_trajectory_s"]),
            _fmt(r["capture_rollout_s"]),
        )
    table.caption = (
        "capture = (naive - predictor) / (naive - truth): the share of the truth's gain over naive"
    )
    return table


def _leave_one_out(
    args: argparse.Namespace,
    config: SimConfig,
    options: EvalOptions,
    on_tick: Callable[[float, int], None],
    progress: Progress,
    task: TaskID,
) -> int:
    """`--leave-one-out` (module header): every trace of `--traces`, one table, the JSON by trace."""
    from prorsa.console import table_console
    from prorsa.forecast_eval.loto import run_leave_one_out

    if args.value:
        raise ValueError("--value does not combine with --leave-one-out")
    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    if not traces:
        raise ValueError("--traces names no trace")

    def on_trace(trace: str) -> None:
        progress.update(task, description=f"left out: {trace}", completed=0)

    results = run_leave_one_out(config, options, traces, on_trace, on_tick)
    progress.stop()
    out = table_console()
    out.print(loto_table(results, float(args.horizon)))
    if args.json_path:
        data = {
            "horizon_s": float(args.horizon),
            "traces": {t: r.to_json(float(args.horizon)) for t, r in results.items()},
        }
        with open(args.json_path, "w") as f:
            json.dump(data, f, indent=1)
        out.print(f"wrote {args.json_path}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run `prorsa forecast-eval`; returns the exit code (2 on a bad configuration)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from prorsa.console import table_console
    from prorsa.forecast_eval.evaluate import EvalOptions, horizons_with, run_forecast_eval
    from prorsa.workload.errors import WorkloadError
    from services.allocator.policy import PolicyError

    console = Console(stderr=True)
    predictors = tuple(p.strip() for p in args.predictors.split(",") if p.strip())
    try:
        config = config_from_args(args)
        if not (args.horizon > 0):
            raise ValueError(f"--horizon must be > 0, got {args.horizon}")
        options = EvalOptions(
            horizons_s=horizons_with(args.horizon),
            predictors=predictors,
            hints=args.hints,
            refit_interval_s=args.refit_interval,
            seed=args.seed,
            split=args.split,
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

            if args.leave_one_out:
                return _leave_one_out(args, config, options, on_tick, progress, task)
            result = run_forecast_eval(config, options, on_tick=on_tick)
            value = None
            if args.value:
                from prorsa.forecast_eval.split import split_workload
                from prorsa.forecast_eval.value import predictor_value

                names = args.value_predictors or args.predictors
                value_names = [p.strip() for p in names.split(",") if p.strip()]
                workload = split_workload(
                    config.workload,  # type: ignore[arg-type]
                    args.split,
                    batch_size=config.batch_size,
                    group_size=config.group_size,
                    seed=config.seed,
                )
                progress.update(task, description="value runs")
                held = dataclasses.replace(config, workload=workload)
                value = predictor_value(held, value_names, args.value_policy)
    except (ValueError, KeyError, WorkloadError, PolicyError) as exc:
        print(f"prorsa forecast-eval: {exc}", file=sys.stderr)
        return 2
    out = table_console()
    for h in options.horizons_s if args.all_horizons else (float(args.horizon),):
        out.print(score_table(result, h))
    if value is not None:
        out.print(value_table(value, args.value_policy))
    data: dict[str, Any] = result.to_json(float(args.horizon))
    if value is not None:
        data = {**data, "value": value, "run": {**data["run"], "value_policy": args.value_policy}}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(data, f, indent=1)
        out.print(f"wrote {args.json_path}")
    return 0

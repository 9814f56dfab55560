"""`prorsa profile --backend vllm --model PATH [--json FILE]`: measure a real engine and write a simulator profile.

Starts one vLLM engine, times prefills over a grid of (new, cached) prompt lengths and decode steps over a grid of
batch sizes and contexts (`prorsa.calibrate.measure.Grid`), fits the performance model's coefficients by least
squares (`prorsa.calibrate.fit`) and writes a profile file that `load_profile(path)` reads: `"base": "cpu-tiny"`
supplies what is not measured (KV transfer, role switch), every fitted field overrides it. Use the file with
`prorsa sim --profile FILE`, the allocator's `--profile`, or `prorsa up --profile FILE`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported at run time only: the CLI imports every command module to build its parser
    from rich.console import Console

    from prorsa.calibrate.fit import Fit
    from prorsa.calibrate.measure import Grid, Meter
    from prorsa.calibrate.session import EngineOptions


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("vllm",), default="vllm", help="engine to measure (vLLM only)")
    p.add_argument(
        "--model", required=True, help="model directory (e.g. one written by `prorsa tiny-model DIR`)"
    )
    p.add_argument("--json", default=None, help="write the profile here (default: print it)")
    p.add_argument("--name", default=None, help="profile name (default: calibrated-<model dir name>)")
    p.add_argument("--base", default="cpu-tiny", help="built-in profile for the fields not measured")
    p.add_argument(
        "--dtype",
        default="auto",
        help="engine dtype, as the engines it stands for run (float32 on CPUs without bf16: much faster)",
    )
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3, help="passes over the grid (the mean of each point)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")


def grid_for(args: argparse.Namespace) -> Grid:
    """The default grid, with the longest prompts dropped where the model length cannot hold them."""
    from prorsa.calibrate.measure import Grid

    base = Grid()
    fits = args.max_model_len - 1  # room for the one generated token
    return Grid(
        prefill_new_tokens=tuple(n for n in base.prefill_new_tokens if n <= fits),
        prefill_cached_points=tuple((c, n) for c, n in base.prefill_cached_points if c + n <= fits),
        decode_batches=base.decode_batches,
        decode_contexts=tuple(c for c in base.decode_contexts if c + base.decode_steps + 1 <= fits),
        decode_steps=base.decode_steps,
        repeats=max(1, args.repeats),
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from prorsa.calibrate.session import EngineOptions

    console = Console(stderr=True)  # the profile itself may go to stdout
    # vLLM logs every engine detail at INFO; keep the progress bars readable (set it to INFO to see them).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not Path(args.model).is_dir():
        console.print(f"prorsa profile: no model directory at {args.model}")
        return 2
    options = EngineOptions(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
    )
    try:
        profile = asyncio.run(_profile(options, grid_for(args), args, console))
    except ModuleNotFoundError as exc:
        console.print(f"prorsa profile: --backend vllm needs vLLM installed ({exc})")
        return 2
    text = json.dumps(profile, indent=2) + "\n"
    if args.json:
        Path(args.json).write_text(text)
        console.print(f"profile written to {args.json}")
    else:
        print(text, end="")
    return 0


async def _profile(
    options: EngineOptions, grid: Grid, args: argparse.Namespace, console: Console
) -> dict[str, Any]:
    import numpy as np

    from prorsa.calibrate.measure import Meter
    from prorsa.calibrate.session import (
        describe,
        fitted_profile,
        progress_bars,
        started_engine,
    )
    from services.runtime.model_profiles import profile_from_json

    name = args.name or f"calibrated-{Path(options.model).name}"
    async with started_engine(options, console) as engine:
        meter = Meter(engine, np.random.default_rng(args.seed))
        with progress_bars(console, grid.points) as progress:
            await meter.measure(grid, progress)
        profile, prefill, decode = fitted_profile(meter, engine, name, describe(options))
    profile["base"] = args.base
    profile_from_json(profile)  # a file `load_profile` would reject must not be written
    _report(console, meter, prefill, decode)
    return profile


def _report(console: Console, meter: Meter, prefill: Fit, decode: Fit) -> None:
    """The measured points beside the fitted model's times, the coefficients and the fit quality."""
    from rich.table import Table

    points = Table(title="measured vs fitted (means)")
    for column in ("point", "measured ms", "model ms", "error"):
        points.add_column(column, justify="right")
    rows = [
        (f"prefill new {s.new_tokens}, cached {s.cached_tokens}", s.seconds, p)
        for s, p in zip(meter.prefill_samples(), prefill.predicted_s, strict=True)
    ]
    rows += [
        (f"decode batch {s.batch}, context {s.total_context_tokens:,.0f}", s.step_s, p)
        for s, p in zip(meter.decode_samples(), decode.predicted_s, strict=True)
    ]
    for label, measured_s, model_s in rows:
        points.add_row(
            label, f"{measured_s * 1e3:.1f}", f"{model_s * 1e3:.1f}", f"{model_s / measured_s - 1:+.0%}"
        )
    console.print(points)
    table = Table(title="fitted coefficients")
    table.add_column("field")
    table.add_column("value", justify="right")
    for fit in (prefill, decode):
        for field, value in fit.coefficients.items():
            table.add_row(field, f"{value:.4g}")
    console.print(table)
    for label, fit in (("prefill", prefill), ("decode", decode)):
        console.print(
            f"{label}: {fit.samples} points, relative RMSE {fit.rel_rmse:.1%}, worst {fit.max_rel_error:.1%}"
        )

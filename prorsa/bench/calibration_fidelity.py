"""Does a calibrated profile predict the real engine on a workload it was not fitted on?

`python -m prorsa.bench.calibration_fidelity --model PATH [--dtype float32] [--rounds 3] [--json FILE]`

1. Calibrate: `prorsa profile`'s grid on one real vLLM engine (isolated prefills of 64–3,200 tokens with and
   without a cached prefix; lock-step decode batches of 1–8 sequences at 128 and 1,536 tokens of context), fitted
   by least squares (`prorsa.calibrate`).
2. Workload B, another shape: requests with 200–1,200-token prompts and 20–120 output tokens, `--concurrency` in
   flight (closed loop; continuous batching mixes prefill chunks into decode steps, which the grid never did), run
   on the same real engine.
3. The same requests at the same concurrency through the performance model with the fitted profile
   (`prorsa.calibrate.replay`: the simulated engine's scheduler in virtual time).
4. Report throughput (output tokens/s over the makespan) and mean per-request latency (submit → last token), and
   the model's % error on each.

On a shared machine the engine's speed drifts with other jobs' load. So the grid and workload B are interleaved:
each of `--rounds` rounds runs one pass over the grid, then workload B once; the fit uses every round's means and
the real figures pool every round. Load drift then weighs on calibration and workload alike; the per-round real
figures show how much the machine itself moved.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from prorsa.calibrate.measure import Grid, Meter, run_workload
from prorsa.calibrate.replay import WorkloadResult, make_workload, relative_error, replay
from prorsa.calibrate.session import (
    EngineOptions,
    describe,
    fitted_profile,
    progress_bars,
    started_engine,
)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    requests: int = 16
    prompt_tokens: tuple[int, int] = (200, 1200)
    output_tokens: tuple[int, int] = (20, 120)
    concurrency: int = 4
    seed: int = 1


def pooled(results: list[WorkloadResult]) -> dict[str, float]:
    """Throughput and latencies over every round (total tokens over total makespan; means over all requests)."""
    tokens = sum(t.output_tokens for r in results for t in r.timings)
    timings = [t for r in results for t in r.timings]
    return {
        "output_tokens_per_s": tokens / sum(r.makespan_s for r in results),
        "mean_latency_s": statistics.fmean(t.latency_s for t in timings),
        "mean_ttft_s": statistics.fmean(t.ttft_s for t in timings),
    }


def figures(result: WorkloadResult) -> dict[str, float]:
    return {
        "output_tokens_per_s": result.output_tokens_per_s,
        "mean_latency_s": result.mean_latency_s,
        "mean_ttft_s": result.mean_ttft_s,
    }


async def run_bench(
    options: EngineOptions, grid: Grid, spec: WorkloadSpec, rounds: int, console: Console
) -> dict[str, Any]:
    """Interleaved calibration and workload rounds on one engine; returns the figures as a JSON-ready dict."""
    import numpy as np

    workload = make_workload(spec.requests, spec.prompt_tokens, spec.output_tokens, spec.seed, prefix="b")
    totals = {k: v * rounds // grid.repeats for k, v in grid.points.items()}
    totals["workload"] = spec.requests * rounds
    async with started_engine(options, console) as engine:
        meter = Meter(engine, np.random.default_rng(spec.seed))
        real: list[WorkloadResult] = []
        with progress_bars(console, totals) as progress:
            for _ in range(rounds):
                await meter.prefill_pass(grid, progress)
                await meter.decode_pass(grid, progress)
                real.append(await run_workload(engine, workload, spec.concurrency, meter.rng, progress))
        profile, prefill_fit, decode_fit = fitted_profile(meter, engine, "fidelity", describe(options))
        max_model_len = engine.max_model_len  # vLLM's resolved value (an engine argument may set it)
    from services.runtime.model_profiles import profile_from_json

    model = figures(replay(profile_from_json(profile), workload, spec.concurrency, max_model_len))
    measured = pooled(real)
    return {
        "engine": describe(options),
        "workload": {**dataclasses.asdict(spec), "rounds": rounds},
        "fit": {
            "prefill": {"rel_rmse": prefill_fit.rel_rmse, "points": prefill_fit.samples},
            "decode": {"rel_rmse": decode_fit.rel_rmse, "points": decode_fit.samples},
        },
        "profile": profile,
        "real": measured,
        "real_rounds": [figures(r) for r in real],
        "model": model,
        "error": {k: relative_error(model[k], measured[k]) for k in measured},
    }


def print_report(console: Console, out: dict[str, Any]) -> None:
    table = Table(title="workload B: real engine vs calibrated model")
    table.add_column("figure")
    table.add_column("real (pooled)", justify="right")
    table.add_column("real per round", justify="right")
    table.add_column("model", justify="right")
    table.add_column("model error", justify="right")
    for key, label in (
        ("output_tokens_per_s", "throughput, output tok/s"),
        ("mean_latency_s", "mean latency, s"),
        ("mean_ttft_s", "mean TTFT, s"),
    ):
        rounds = ", ".join(f"{r[key]:.3g}" for r in out["real_rounds"])
        table.add_row(
            label, f"{out['real'][key]:.3g}", rounds, f"{out['model'][key]:.3g}", f"{out['error'][key]:+.1%}"
        )
    console.print(table)
    fit = out["fit"]
    console.print(
        f"fit: prefill relative RMSE {fit['prefill']['rel_rmse']:.1%} over {fit['prefill']['points']} points, "
        f"decode {fit['decode']['rel_rmse']:.1%} over {fit['decode']['points']} points"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="model directory (e.g. written by `prorsa tiny-model DIR`)")
    p.add_argument("--dtype", default="float32", help="engine dtype (float32: fast on CPUs without bf16)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved calibration + workload rounds")
    default = WorkloadSpec()
    p.add_argument("--requests", type=int, default=default.requests, help="workload B requests per round")
    p.add_argument("--concurrency", type=int, default=default.concurrency, help="requests in flight")
    p.add_argument("--json", default=None, help="also write the figures (and the fitted profile) here")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    console = Console()
    spec = WorkloadSpec(requests=args.requests, concurrency=args.concurrency)
    grid = Grid(repeats=1)  # one grid pass per round
    out = asyncio.run(
        run_bench(EngineOptions(model=args.model, dtype=args.dtype), grid, spec, args.rounds, console)
    )
    print_report(console, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        console.print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

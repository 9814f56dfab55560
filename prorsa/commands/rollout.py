"""`prorsa rollout`: agentic RL rollout over the live system (embedded NATS unless --nats, services, engines)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="swe", help="workload spec (swe, profile:math, mix:A+B, ...)")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--backend", choices=("sim", "vllm"), default="sim")
    p.add_argument("--model", default=None, help="model path for --backend vllm")
    p.add_argument("--dtype", default=None, help="--backend vllm: model dtype (float32 on CPUs without bf16)")
    p.add_argument(
        "--profile",
        default=None,
        help="engine performance profile: sim engines run as it (default qwen3-235b); vLLM engines report it to "
        "the allocator (a JSON from `prorsa profile`; default cpu-tiny under vllm-cpu, else none)",
    )
    p.add_argument(
        "--policy", default="prorsa", help="allocator policy (colocated, static:P:D, reactive, ...)"
    )
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--group-size", type=int, default=1)
    p.add_argument("--training-s", type=float, default=30.0, help="trainer seconds per step (workload time)")
    p.add_argument("--speedup", type=float, default=20.0, help="sim: workload seconds per wall second")
    p.add_argument(
        "--token-scale", type=float, default=1.0, help="scale every token count (tiny real models)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nats", default=None, help="use this NATS server instead of an embedded one")
    p.add_argument("--log-dir", default=None, help="write every child's log here")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--plot-dir", default=None)
    p.add_argument("--report", metavar="DIR", default=None, help="write a self-contained HTML report here")


def default_vllm_profile() -> str:
    """cpu-tiny (measured on vllm-cpu with the tiny model, CALIBRATION.md) where vllm-cpu is what is installed."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return ""
    return "cpu-tiny"


def live_config(args: argparse.Namespace, policy: str | None = None):  # noqa: ANN201 - LiveConfig (lazy import)
    from prorsa.rollout.live import LiveConfig

    return LiveConfig(
        workload=args.workload,
        engines=args.engines,
        backend=args.backend,
        model=args.model,
        profile=args.profile or "qwen3-235b",
        engine_profile=(args.profile or default_vllm_profile()) if args.backend == "vllm" else "",
        policy=policy or args.policy,
        mode=args.mode,
        staleness=args.staleness,
        steps=args.steps,
        batch_size=args.batch_size,
        group_size=args.group_size,
        training_s=args.training_s,
        speedup=args.speedup,
        seed=args.seed,
        token_scale=args.token_scale,
        nats_url=args.nats,
        log_dir=args.log_dir,
        extra_engine_args=["--dtype", args.dtype] if args.dtype else [],
    )


def run_with_progress(cfg, label: str):  # noqa: ANN001, ANN201 - LiveConfig → LiveResult
    """Run one live rollout with a rich progress bar over its trajectories."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from prorsa.rollout.live import run_live

    total = cfg.batch_size * cfg.steps
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    ) as bar:
        task = bar.add_task(label, total=total)
        return asyncio.run(run_live(cfg, lambda what, done, n: bar.update(task, completed=done)))


def run(args: argparse.Namespace) -> int:
    from prorsa.console import table_console
    from prorsa.rollout.report import plot_live, summary_table

    cfg = live_config(args)
    result = run_with_progress(cfg, f"rollout {args.workload} · {args.policy}")
    console = table_console()
    for note in result.notes:
        console.print(f"[dim]note: {note}[/dim]")
    title = f"prorsa rollout · {args.workload} · {args.engines} × {args.backend} engines · {args.mode}"
    console.print(summary_table({args.policy: result.summary}, title))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"config": vars(cfg), **result.summary}, f, indent=1, default=str)
    if args.plot_dir:
        os.makedirs(args.plot_dir, exist_ok=True)
        path = os.path.join(args.plot_dir, f"rollout-{args.policy.replace(':', '_')}.png")
        plot_live(result.recorder, path, f"{args.workload} · {args.policy}")
        console.print(f"plot: {path}")
    if args.report:
        from prorsa.commands import reporting

        runs = reporting.live_runs(
            {args.policy: result}, (args.profile or "qwen3-235b") if args.backend == "sim" else None
        )
        reporting.write(console, args.report, "rollout.html", title, runs, [*result.notes])
    return 0 if result.summary["trajectories_completed"] == result.summary["trajectories_expected"] else 1

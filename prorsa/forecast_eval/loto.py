"""Leave-one-trace-out: each shipped agent trace forecast by a forecaster that has seen every trace but that one.

What "seen" means here. The forecaster fits nothing offline: every distribution of the lifecycle model is learnt
online from the run itself. What a new workload starts from, before its own first trajectories say anything, is
its prior; in this evaluation that prior is `PriorSamples` pooled from the *other* traces (their tool latencies,
output tokens per turn and new tokens per later turn, each trace weighing the same), in place of the round
stand-ins, each kind's replaced by the left-out trace's first observation of it (`lifecycle_model.PriorSamples`
says why it is not kept beside them). So every figure of a left-out trace comes from a forecaster whose only
knowledge of that trace is what it observed while forecasting it.

Targets (issue 32), 10 s ahead, on every trace: prefill WAPE <= 0.7x naive's, decode WAPE <= 0.9x naive's,
coverage80 (the share of actuals within q10..q90, prefill and decode pooled) in 0.75-0.85.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from prorsa.forecast_eval.evaluate import EvalOptions, EvalResult, run_forecast_eval
from prorsa.forecast_eval.split import split_workload
from prorsa.sim.runner import SimConfig
from services.forecaster.lifecycle_model import PriorSamples

# Every agent trace and task profile the package ships (prorsa/data, prorsa/workload/profiles).
AGENT_TRACES: tuple[str, ...] = (
    "swe",
    "profile:general",
    "profile:coding",
    "profile:math",
    "mooncake",
    "azure-code",
    "azure-conv",
)
# (ratio to naive's WAPE at most, for prefill and decode; coverage80 range)
TARGETS = {"prefill_vs_naive": 0.7, "decode_vs_naive": 0.9, "coverage80": (0.75, 0.85)}
_PER_TRACE = 512  # quantiles each trace contributes per kind, so each weighs the same whatever its size


def trace_samples(
    spec: str, split: str = "all", batch_size: int = 64, seed: int = 0, steps: int = 2
) -> PriorSamples:
    """A trace's tool latencies, outputs and later turns' new tokens (its first `steps` steps, as the workload
    draws them), each as `_PER_TRACE` quantiles (empty where the trace has none: single-turn traces)."""
    workload = split_workload(spec, split, batch_size=batch_size, group_size=1, seed=seed)
    gaps: list[float] = []
    outputs: list[float] = []
    new: list[float] = []
    for k in range(steps):
        for traj in workload.step(k):
            turns = traj.turns
            outputs += [t.output_tokens for t in turns]
            gaps += [t.tool_latency_s for t in turns[:-1]]
            new += [t.new_prompt_tokens for t in turns[1:]]

    def q(x: list[float]) -> np.ndarray:
        a = np.asarray(x, dtype=np.float64)
        return np.quantile(a, (np.arange(_PER_TRACE) + 0.5) / _PER_TRACE) if len(a) else np.zeros(0)

    return PriorSamples(gap_s=q(gaps), output_tokens=q(outputs), new_tokens=q(new))


def prior_without(
    left_out: str,
    traces: Sequence[str] = AGENT_TRACES,
    split: str = "all",
    batch_size: int = 64,
    seed: int = 0,
) -> PriorSamples:
    """The other traces' samples pooled (module header); `left_out` contributes nothing."""
    parts = [trace_samples(t, split, batch_size, seed) for t in traces if t != left_out]
    if not parts:
        raise ValueError(f"no trace left besides {left_out!r}")
    return PriorSamples(
        gap_s=np.concatenate([p.gap_s for p in parts]),
        output_tokens=np.concatenate([p.output_tokens for p in parts]),
        new_tokens=np.concatenate([p.new_tokens for p in parts]),
    )


def run_leave_one_out(
    config: SimConfig,
    options: EvalOptions,
    traces: Sequence[str] = AGENT_TRACES,
    on_trace: Callable[[str], None] | None = None,
    on_tick: Callable[[float, int], None] | None = None,
) -> dict[str, EvalResult]:
    """Each trace of `traces` evaluated as `config` with that workload, the forecaster's prior pooled from the
    others. Raises what `run_forecast_eval` raises on a bad configuration."""
    out: dict[str, EvalResult] = {}
    for trace in traces:
        if on_trace is not None:
            on_trace(trace)
        prior = prior_without(trace, traces, options.split, seed=config.seed)
        cfg = dataclasses.replace(config, workload=trace)
        out[trace] = run_forecast_eval(cfg, dataclasses.replace(options, prior=prior), on_tick=on_tick)
    return out


def misses(row: dict[str, float]) -> list[str]:
    """The targets (module header) a summary row (`EvalResult.summary`) misses, as short phrases."""
    out = []
    p, d, c = row.get("prefill_wape_vs_naive"), row.get("decode_wape_vs_naive"), row.get("coverage80")
    if p is None or not p <= TARGETS["prefill_vs_naive"]:
        out.append(f"prefill {p:.2f}x naive" if p == p and p is not None else "prefill: no naive")
    if d is None or not d <= TARGETS["decode_vs_naive"]:
        out.append(f"decode {d:.2f}x naive" if d == d and d is not None else "decode: no naive")
    lo, hi = TARGETS["coverage80"]
    if c is None or not lo <= c <= hi:
        out.append(f"coverage80 {c:.3f}")
    return out

"""Decision latency of the allocator policies: one forecast + cluster view in, one plan (or none) out.

    python -m prorsa.bench.allocator_speed [--engines 256] [--trajectories 10000] [--decisions 300]
        [--step-every 60] [--policies prorsa,reactive,dynamo]

Every decision gets a different view (seeded random roles, queues, batches, KV) and a forecast over five horizons,
so neither hysteresis nor any cache makes later decisions cheaper than the first. The time measured is
`policy.decide(view)` — what the allocator service and the simulator call every interval. Building the view is not
timed (the service builds it from messages it already holds). Dynamo refits its ARIMA predictors on its slow
interval (60 s of view time = every 12th decision); statsmodels is imported before timing starts. The forecast
carries the demand outlook of `trajectories` live trajectories (what prorsa reads of them: per task, counts by
phase and the turns ahead — no per-trajectory list reaches the allocator). Every `step_every` decisions a new RL
step starts (the tracker's count of started trajectories jumps by a batch), so the decisions timed include
prorsa's step starts, which replay the last step through the turn model for the splits measured on its mix (the
full search over every candidate runs only while the cluster idles, which a live population never shows).
Target: ≤ 20 ms p99 at 256 engines.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from proto import DemandForecast, Estimate, HorizonForecast, Quantiles, TaskOutlook
from services.allocator.policy import ClusterView, EngineView
from services.allocator.registry import make_policy

HORIZONS_S = (5.0, 10.0, 20.0, 30.0, 60.0)


@dataclass(frozen=True, slots=True)
class Timing:
    policy: str
    engines: int
    decisions: int
    plans: int  # decisions that moved at least one engine
    p50_ms: float
    p99_ms: float
    max_ms: float


def _quantiles(x: float) -> Quantiles:
    return Quantiles(q10=0.8 * x, q50=x, q90=1.25 * x)


Outlook = tuple[
    list[TaskOutlook], int
]  # the forecast's outlook and the tracker's count of started trajectories


def random_forecast(
    rng: np.random.Generator, n: int, now: float, outlook: Outlook | None = None
) -> DemandForecast:
    """Demand of the order of what `n` engines serve, in a random prefill : decode mix, with `outlook`."""
    prefill_rate = float(rng.uniform(0.1, 1.0)) * n * 25_000.0  # prompt tokens/s
    concurrency = float(rng.uniform(0.2, 1.0)) * n * 150.0
    decode_rate = concurrency * 25.0  # ~25 tokens/s per sequence
    ctx = float(rng.uniform(2_000, 20_000))
    horizons = [
        HorizonForecast(
            horizon_s=h,
            prefill_tokens=_quantiles(prefill_rate * h),
            decode_tokens=_quantiles(decode_rate * h),
            decode_concurrency=_quantiles(concurrency),
            kv_tokens=_quantiles(concurrency * ctx),
        )
        for h in HORIZONS_S
    ]
    tasks, started = outlook if outlook is not None else ([], 0)
    return DemandForecast(
        ts_s=now,
        predictor="bench",
        horizons=horizons,
        outlook=tasks,
        outlook_horizon_s=5.0 if outlook is not None else 0.0,
        started_total=started,
    )


def _figure(x: float, observed: int = 1000) -> Estimate:
    return Estimate(mean=x, q10=0.5 * x, q50=0.9 * x, q90=1.8 * x, observed=observed)


def random_outlook(rng: np.random.Generator, trajectories: int, step: int = 0) -> Outlook:
    """The outlook of `trajectories` live trajectories of RL step `step` (one task) in random phases."""
    if not trajectories:
        return [], 0
    q, p, d, t = (int(v) for v in rng.multinomial(trajectories, [0.05, 0.05, 0.5, 0.4]))
    cycle_s = float(rng.uniform(5.0, 30.0))
    task = TaskOutlook(
        task="general",
        queued=q,
        prefill=p,
        decode=d,
        tool_call=t,
        turns=_figure(trajectories * 5.0 / cycle_s, trajectories),
        finished=_figure(trajectories * 5.0 / cycle_s / 30.0, trajectories),
        new_tokens=_figure(float(rng.uniform(100, 3_000))),
        output_tokens=_figure(float(rng.uniform(100, 2_000))),
        context_tokens=_figure(float(rng.uniform(1_000, 60_000)), trajectories),
        tool_s=_figure(float(rng.uniform(0.2, 5.0))),
    )
    return [task], (step + 1) * trajectories  # each step is a fresh batch


def random_view(rng: np.random.Generator, n: int, now: float, outlook: Outlook | None = None) -> ClusterView:
    """A cluster of `n` engines split at random between prefill and decode, with queues and running work."""
    engines = []
    for i in range(n):
        role = "prefill" if rng.random() < 0.4 else "decode"
        batch = int(rng.integers(0, 200)) if role == "decode" else 0
        queued = int(rng.integers(0, 40_000)) if role == "prefill" else 0
        ctx = int(rng.integers(1_000, 20_000))
        engines.append(
            EngineView(
                engine_id=f"engine-{i:04d}",
                role=role,
                running=batch or int(queued > 0),
                waiting=int(rng.integers(0, 4)),
                queued_prefill_tokens=queued,
                decode_batch=batch,
                kv_used_tokens=batch * ctx,
                kv_capacity_tokens=1_900_000,
                in_flight_tokens=queued + batch * int(rng.integers(10, 500)),
                switching=False,
                prefill_tokens_per_s=float(rng.uniform(20_000, 50_000)) if queued else 0.0,
                decode_tokens_per_s=float(batch * rng.uniform(15, 35)),
            )
        )
    return ClusterView(
        now=now,
        engines=tuple(engines),
        prefill_queue_tokens=int(rng.integers(0, 2_000_000)),
        decode_queue_len=int(rng.integers(0, 50)),
        prefill_tokens_per_s=float(rng.uniform(0, n * 20_000)),
        decode_tokens_per_s=float(rng.uniform(0, n * 3_000)),
        forecast=random_forecast(rng, n, now, outlook),
        recent_window_s=5.0,
        recent_requests=int(rng.integers(0, 50 * n)),
        recent_mean_isl_tokens=float(rng.uniform(200, 4_000)),
        recent_mean_cached_tokens=float(rng.uniform(0, 20_000)),
        recent_mean_osl_tokens=float(rng.uniform(100, 2_000)),
    )


def bench(
    spec: str,
    engines: int = 256,
    decisions: int = 300,
    seed: int = 0,
    trajectories: int = 10_000,
    step_every: int = 60,
) -> Timing:
    """Time `decisions` calls of `decide` for policy `spec` on fresh random views (5 s of view time apart), each
    with a forecast whose outlook holds `trajectories` live trajectories; a new step every `step_every`."""
    rng = np.random.default_rng(seed)
    policy = make_policy(spec, engines)
    per_step = max(step_every, 1)
    outlooks = [random_outlook(rng, trajectories, step) for step in range(-(-decisions // per_step))]
    views = [
        random_view(rng, engines, 5.0 * (k + 1), outlooks[k // per_step] if trajectories else None)
        for k in range(decisions)
    ]
    times: list[float] = []
    plans = 0
    for v in views:
        t0 = time.perf_counter()
        plan = policy.decide(v)
        times.append(time.perf_counter() - t0)
        plans += plan is not None
    ms = np.asarray(times) * 1e3
    return Timing(
        policy=spec,
        engines=engines,
        decisions=decisions,
        plans=plans,
        p50_ms=float(np.percentile(ms, 50)),
        p99_ms=float(np.percentile(ms, 99)),
        max_ms=float(ms.max()),
    )


def _warm_statsmodels() -> None:
    from statsmodels.tsa.arima.model import ARIMA  # noqa: F401 - a one-off import of seconds, not a decision


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Decision latency of the allocator policies")
    parser.add_argument("--engines", type=int, default=256)
    parser.add_argument("--decisions", type=int, default=300)
    parser.add_argument("--trajectories", type=int, default=10_000, help="live trajectories in each outlook")
    parser.add_argument("--step-every", type=int, default=60, help="decisions per RL step (60: 5 min)")
    parser.add_argument("--policies", default="prorsa,reactive,dynamo")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    specs = [s for s in args.policies.split(",") if s]
    if any(s.startswith("dynamo") for s in specs):
        _warm_statsmodels()
    header = ("policy", "engines", "decisions", "plans", "p50 ms", "p99 ms", "max ms")
    print(f"{header[0]:<12} " + " ".join(f"{h:>{max(5, len(h))}}" for h in header[1:]))
    for spec in specs:
        t = bench(spec, args.engines, args.decisions, args.seed, args.trajectories, args.step_every)
        print(
            f"{t.policy:<12} {t.engines:>7} {t.decisions:>9} {t.plans:>5} "
            f"{t.p50_ms:>6.2f} {t.p99_ms:>6.2f} {t.max_ms:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

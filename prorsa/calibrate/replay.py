"""A workload of independent requests at fixed concurrency, and its replay through the performance model (pure).

The same `WorkloadRequest`s run on a real engine (`measure.Meter.run_workload`) and here, through the simulated
engine's scheduler (`services.engine_agent.backends.sim_scheduler.SimScheduler`: continuous batching, chunked
prefill, step times from `perf_model`), in virtual time. Both are closed loops: `concurrency` requests are in
flight, and each one that finishes is replaced by the next in order at that moment. So the two runs see the same
arrivals given the same service times, and their throughput and latencies can be compared one to one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from services.engine_agent.backends.sim_scheduler import SimScheduler, SimSeq
from services.engine_agent.backends.sim_tokens import SimTokens
from services.runtime.perf_model import ModelProfile


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    request_id: str
    prompt_tokens: int
    output_tokens: int  # generated exactly (EOS ignored)


@dataclass(frozen=True, slots=True)
class RequestTiming:
    request_id: str
    submit_s: float  # seconds from the start of the run
    first_token_s: float
    finish_s: float
    output_tokens: int

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.submit_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.submit_s


@dataclass(frozen=True, slots=True)
class WorkloadResult:
    timings: tuple[RequestTiming, ...]

    @property
    def makespan_s(self) -> float:
        return max(t.finish_s for t in self.timings) - min(t.submit_s for t in self.timings)

    @property
    def output_tokens_per_s(self) -> float:
        return sum(t.output_tokens for t in self.timings) / self.makespan_s

    @property
    def mean_latency_s(self) -> float:
        return float(np.mean([t.latency_s for t in self.timings]))

    @property
    def mean_ttft_s(self) -> float:
        return float(np.mean([t.ttft_s for t in self.timings]))


def make_workload(
    n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int, prefix: str = "w"
) -> list[WorkloadRequest]:
    """`n` requests with prompt and output lengths drawn uniformly from the inclusive ranges."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(prompt_range[0], prompt_range[1] + 1, size=n)
    outputs = rng.integers(output_range[0], output_range[1] + 1, size=n)
    return [
        WorkloadRequest(f"{prefix}{i}", int(p), int(o))
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]


def _seq(r: WorkloadRequest) -> SimSeq:
    return SimSeq(
        request_id=r.request_id,
        traj_id=r.request_id,  # one trajectory per request: no prefix shared, as on the real engine
        mode="generate",
        context_tokens=r.prompt_tokens,
        pos=0,
        end=r.output_tokens,
        end_reason="length",
        tokens=SimTokens(r.request_id),
        want_logprobs=False,
    )


def replay(
    profile: ModelProfile, requests: list[WorkloadRequest], concurrency: int, max_model_len: int = 1 << 20
) -> WorkloadResult:
    """Run `requests` through the modelled engine (mixed role), `concurrency` at a time; virtual seconds.

    Raises ValueError on an empty workload or a concurrency below 1."""
    if not requests or concurrency < 1:
        raise ValueError("replay needs at least one request and concurrency >= 1")
    sched = SimScheduler(profile, "mixed", max_model_len)
    waiting = deque(requests)
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    done: list[RequestTiming] = []

    def submit(now: float) -> None:
        r = waiting.popleft()
        submitted[r.request_id] = now
        sched.add_prefill(_seq(r))

    for _ in range(min(concurrency, len(waiting))):
        submit(0.0)
    now = 0.0
    while (step := sched.plan(now)) is not None:
        now += step.duration_s
        for seq in sched.apply(step, now):
            rid = seq.request_id
            if seq.prefill_info is not None and rid not in first:
                first[rid] = now
            if seq.done:
                done.append(RequestTiming(rid, submitted[rid], first[rid], now, seq.pos))
                if waiting:
                    submit(now)
    return WorkloadResult(tuple(sorted(done, key=lambda t: t.request_id)))


def relative_error(model: float, measured: float) -> float:
    """(model - measured) / measured."""
    return (model - measured) / measured

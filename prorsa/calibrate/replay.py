"""A workload of independent requests at fixed concurrency, and its replay through the performance model (pure).

The same `WorkloadRequest`s run on a real engine (`measure.Meter.run_workload`) and here, through the engine core
that ships (`services.engine_agent.solo_engine.SoloEngine`: continuous batching, chunked prefill, step times from
`perf_model`), in virtual time. Both are closed loops: `concurrency` requests are in
flight, and each one that finishes is replaced by the next in order at that moment. So the two runs see the same
arrivals given the same service times, and their throughput and latencies can be compared one to one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from services.engine_agent.engine_core import CoreSeq
from services.engine_agent.solo_engine import SoloEngine
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


def replay(
    profile: ModelProfile, requests: list[WorkloadRequest], concurrency: int, max_model_len: int = 1 << 20
) -> WorkloadResult:
    """Run `requests` through the modelled engine (mixed role), `concurrency` at a time; virtual seconds.
    Outputs are capped by `max_model_len` as the real engine caps them.

    Raises ValueError on an empty workload or a concurrency below 1."""
    if not requests or concurrency < 1:
        raise ValueError("replay needs at least one request and concurrency >= 1")
    engine = SoloEngine(profile, "mixed")
    waiting = deque(requests)
    by_rid: dict[int, WorkloadRequest] = {}
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    done: list[RequestTiming] = []

    def submit() -> None:
        r = waiting.popleft()
        submitted[r.request_id] = engine.now
        out = max(min(r.output_tokens, max_model_len - r.prompt_tokens), 1)
        # One trajectory per request: no prefix shared, as on the real engine.
        seq = CoreSeq(len(by_rid), r.request_id, r.prompt_tokens, out)
        by_rid[seq.rid] = r
        engine.submit(seq)

    for _ in range(min(concurrency, len(waiting))):
        submit()
    while (t := engine.next_event_s()) is not None:
        engine.advance(t)
        for seq, at in engine.prefilled:
            first[by_rid[seq.rid].request_id] = at
        for seq, at in engine.finished:
            rid = by_rid[seq.rid].request_id
            done.append(RequestTiming(rid, submitted[rid], first[rid], at, seq.output_tokens))
        finished = len(engine.finished)
        engine.prefilled.clear()
        engine.finished.clear()
        for _ in range(min(finished, len(waiting))):
            submit()
    return WorkloadResult(tuple(sorted(done, key=lambda t: t.request_id)))


def relative_error(model: float, measured: float) -> float:
    """(model - measured) / measured."""
    return (model - measured) / measured

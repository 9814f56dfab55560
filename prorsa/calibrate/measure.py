"""Timings of a real vLLM engine (`VllmEngine`) on a grid of prefill and decode shapes, for `fit`.

Prefill: one request generating one token; its time is submit → first token, the same
span the performance model's `prefill_time_s` stands for (one engine step of the prompt, scheduling and
sampling included). A cached point first runs its prefix (itself a no-cache sample), then prefix + new tokens;
the cached count is what vLLM reports (whole KV blocks). Every prompt is drawn at random, so no point meets an
earlier one's prefix by accident.

Decode: `batch` requests of `context` prompt tokens each (the same prompts for every run of one context, see
`Meter.decode_prompts`), submitted together, each generating `decode_steps + 1` tokens. Between the moment the last of them has its first token and the moment the first of
them finishes, every engine step is a pure decode step of the whole batch: its time is that span divided by the
tokens each request produced inside it. The batch's context is taken at the middle of the span.

Noise. Each point is measured `repeats` times and the mean is kept. Not the median: on a shared machine the
engine's speed has a long tail (other jobs' bursts), and the workloads a profile predicts run through that tail
too, so the mean is what they see. (With medians, the calibrated model came out faster than the real engine in
five of six fidelity runs: docs/benchmarks.md, "Engine calibration".) Every pass visits its points in a random order: on a shared machine the engine's speed drifts with
other jobs' load, and a fixed order (all short contexts, then all long ones) would read that drift as a
coefficient.

Prompts longer than the engine's step budget (`max_num_batched_tokens`) are chunked by vLLM over several steps,
which the one-step prefill model does not describe: keep `prefill_new_tokens`, and the prefixes of the cached
points (measured as no-cache points), within it (2,048 on vLLM's CPU build).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from prorsa.calibrate.fit import DecodeSample, PrefillSample
from prorsa.calibrate.replay import RequestTiming, WorkloadRequest, WorkloadResult

VOCAB_LOW, VOCAB_HIGH = 100, 31_000  # token ids drawn for prompts (inside the tiny model's 32k vocabulary)


@dataclass(frozen=True, slots=True)
class Grid:
    """What to measure. The default runs in ~1-2 minutes on a loaded 2-core CPU machine (tiny model)."""

    prefill_new_tokens: tuple[int, ...] = (64, 256, 512, 1024, 2048)  # no-cache points
    prefill_cached_points: tuple[tuple[int, int], ...] = (  # (cached, new)
        (1024, 128),
        (1024, 512),
        (2048, 256),
        (2048, 1024),
    )
    decode_batches: tuple[int, ...] = (1, 2, 4, 8)
    decode_contexts: tuple[int, ...] = (128, 1024, 2048)  # prompt tokens per sequence
    decode_steps: int = 24
    repeats: int = 3  # runs of every point (prefill and decode); their mean counts

    @property
    def points(self) -> dict[str, int]:
        """Measurement runs per phase (for progress bars)."""
        prefill = (len(self.prefill_new_tokens) + len(self.prefill_cached_points)) * self.repeats
        decode = len(self.decode_batches) * len(self.decode_contexts) * self.repeats
        return {"prefill": prefill, "decode": decode}


Progress = Callable[[str], None]  # called with the phase name after each measured run
Clock = Callable[[], float]  # seconds; wall time (time.perf_counter) unless a test passes a virtual clock


def random_prompt(rng: np.random.Generator, length: int) -> list[int]:
    return [int(t) for t in rng.integers(VOCAB_LOW, VOCAB_HIGH, size=length)]


class Meter:
    """Runs measurement requests on one started engine (`services.engine_agent.backends.vllm_engine.VllmEngine`)."""

    def __init__(self, engine: Any, rng: np.random.Generator, clock: Clock = time.perf_counter) -> None:
        self.engine = engine
        self.rng = rng
        self.clock = clock
        self._n = 0
        self._decode_prompts: dict[int, list[list[int]]] = {}
        self.prefill_runs: dict[tuple[int, int], list[float]] = {}  # (new, cached) -> seconds of each run
        self.decode_runs: dict[tuple[int, int], list[DecodeSample]] = {}  # (batch, prompt tokens) -> runs

    def _rid(self, kind: str) -> str:
        self._n += 1
        return f"calib-{kind}-{self._n}"

    async def one_token(self, prompt: list[int]) -> tuple[float, int]:
        """(submit → first token seconds, cached prompt tokens) of a request generating one token."""
        last = None
        t0 = self.clock()
        first_s = None
        async for chunk in self.engine.generate(self._rid("p"), prompt, 1, temperature=1.0, ignore_eos=True):
            if first_s is None and chunk.token_ids:
                first_s = self.clock() - t0
            last = chunk
        if last is None or first_s is None or last.finish_reason != "length":
            raise RuntimeError(f"calibration prefill did not finish normally: {last}")
        return first_s, int(last.num_cached_tokens)

    async def prefill_pass(self, grid: Grid, progress: Progress) -> None:
        """Measure every prefill point once, in a random order (and the prefix runs of the cached points, as
        no-cache points)."""
        points: list[tuple[int, int]] = [(0, n) for n in grid.prefill_new_tokens]
        points += list(grid.prefill_cached_points)
        for i in self.rng.permutation(len(points)):
            cached_want, new = points[i]
            prefix = random_prompt(self.rng, cached_want)
            if cached_want:
                seconds, cached = await self.one_token(prefix)
                self.prefill_runs.setdefault((cached_want - cached, cached), []).append(seconds)
            seconds, cached = await self.one_token(prefix + random_prompt(self.rng, new))
            self.prefill_runs.setdefault((cached_want + new - cached, cached), []).append(seconds)
            progress("prefill")

    def prefill_samples(self) -> list[PrefillSample]:
        """The mean time of each (new, cached) point over every pass so far."""
        runs = sorted(self.prefill_runs.items())
        return [PrefillSample(n, c, statistics.fmean(ts)) for (n, c), ts in runs]

    def decode_prompts(self, batch: int, context: int) -> list[list[int]]:
        """The first `batch` of the fixed prompts of length `context`: every decode run of one context reuses
        them, so after the first run their prefill is a prefix-cache hit (decode steps read the same KV either
        way) and the grid spends its time decoding."""
        prompts = self._decode_prompts.setdefault(context, [])
        while len(prompts) < batch:
            prompts.append(random_prompt(self.rng, context))
        return prompts[:batch]

    async def decode_step(self, batch: int, context: int, steps: int) -> DecodeSample:
        """Pure decode step time of `batch` sequences of `context` prompt tokens (see the module docstring)."""
        arrivals: list[list[tuple[float, int]]] = [[] for _ in range(batch)]  # (clock, tokens so far)
        prompts = self.decode_prompts(batch, context)

        async def run(i: int) -> None:
            stream = self.engine.generate(
                self._rid("d"), prompts[i], steps + 1, temperature=1.0, ignore_eos=True
            )
            async for chunk in stream:
                if chunk.token_ids:
                    arrivals[i].append((self.clock(), chunk.num_output_tokens))

        await asyncio.gather(*(run(i) for i in range(batch)))
        t0 = max(a[0][0] for a in arrivals)
        t1 = min(a[-1][0] for a in arrivals)
        produced = [_tokens_at(a, t1) - _tokens_at(a, t0) for a in arrivals]
        mean_steps = sum(produced) / batch
        if t1 <= t0 or mean_steps < 1:
            raise RuntimeError(
                f"decode batch {batch} x {context}: no span where the whole batch decoded (raise decode_steps)"
            )
        mid_output = sum(_tokens_at(a, t0) + _tokens_at(a, t1) for a in arrivals) / 2 / batch
        return DecodeSample(batch, batch * (context + mid_output), (t1 - t0) / mean_steps)

    async def decode_pass(self, grid: Grid, progress: Progress) -> None:
        """Measure every (batch, context) decode point once, in a random order."""
        points = [(b, c) for c in grid.decode_contexts for b in grid.decode_batches]
        for i in self.rng.permutation(len(points)):
            batch, context = points[i]
            sample = await self.decode_step(batch, context, grid.decode_steps)
            self.decode_runs.setdefault((batch, context), []).append(sample)
            progress("decode")

    def decode_samples(self) -> list[DecodeSample]:
        """The mean step time of each (batch, context) point over every pass so far."""
        out = []
        for (batch, _), samples in sorted(self.decode_runs.items()):
            step_s = statistics.fmean(s.step_s for s in samples)
            out.append(DecodeSample(batch, statistics.fmean(s.total_context_tokens for s in samples), step_s))
        return out

    async def measure(self, grid: Grid, progress: Progress) -> tuple[list[PrefillSample], list[DecodeSample]]:
        """`grid.repeats` passes over the whole grid; the means of every point."""
        for _ in range(grid.repeats):
            await self.prefill_pass(grid, progress)
            await self.decode_pass(grid, progress)
        return self.prefill_samples(), self.decode_samples()


async def run_workload(
    engine: Any,
    requests: list[WorkloadRequest],
    concurrency: int,
    rng: np.random.Generator,
    progress: Progress,
    clock: Clock = time.perf_counter,
) -> WorkloadResult:
    """Run `requests` on the real engine, `concurrency` at a time (closed loop, as `replay.replay`); seconds on
    `clock` from the start of the run. Prompts are random ids (no prefix shared); EOS is ignored so each request
    generates exactly its `output_tokens`."""
    prompts = {r.request_id: random_prompt(rng, r.prompt_tokens) for r in requests}
    queue = list(reversed(requests))
    timings: list[RequestTiming] = []
    t_start = clock()

    async def worker() -> None:
        while queue:
            r = queue.pop()
            submit = clock() - t_start
            first = None
            last = None
            async for chunk in engine.generate(
                f"wl-{r.request_id}", prompts[r.request_id], r.output_tokens, temperature=1.0, ignore_eos=True
            ):
                if first is None and chunk.token_ids:
                    first = clock() - t_start
                last = chunk
            if last is None or first is None or last.num_output_tokens != r.output_tokens:
                raise RuntimeError(f"workload request {r.request_id} did not complete: {last}")
            finish = clock() - t_start
            timings.append(RequestTiming(r.request_id, submit, first, finish, last.num_output_tokens))
            progress("workload")

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return WorkloadResult(tuple(sorted(timings, key=lambda t: t.request_id)))


def _tokens_at(arrivals: list[tuple[float, int]], t: float) -> int:
    """Tokens a request had received by time `t`."""
    n = 0
    for ts, tokens in arrivals:
        if ts > t:
            break
        n = tokens
    return n

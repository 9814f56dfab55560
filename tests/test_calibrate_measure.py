"""The calibration meter against a fake engine that batches continuously in virtual time, so every figure it should
measure is known exactly: prefill time and cached tokens, the pure decode step of a batch, a closed-loop workload."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from prorsa.calibrate.fit import DecodeSample
from prorsa.calibrate.measure import Grid, Meter, run_workload
from prorsa.calibrate.replay import make_workload

STEP_S, PER_SEQ_S, PER_NEW_TOKEN_S, BLOCK = 0.010, 0.002, 1e-4, 128


class FakeEngine:
    """A step loop: every step takes the waiting prompts whole and one token of every running request, and costs
    STEP_S + PER_SEQ_S x running + PER_NEW_TOKEN_S x uncached prompt tokens of virtual time. Whole blocks of
    prompts seen before are cached."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self.waiting: list[dict[str, Any]] = []
        self.running: list[dict[str, Any]] = []
        self.blocks: set[tuple[int, ...]] = set()
        self._task: asyncio.Task[None] | None = None

    def clock(self) -> float:
        return self.now_s

    def _hit(self, prompt: list[int]) -> int:
        n = 0
        while n + BLOCK < len(prompt) and tuple(prompt[: n + BLOCK]) in self.blocks:
            n += BLOCK
        return n

    async def generate(self, rid: str, prompt: list[int], max_tokens: int, **_: Any) -> AsyncIterator[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        req = {"prompt": prompt, "left": max_tokens, "out": 0, "queue": queue, "t0": self.now_s}
        req["cached"] = self._hit(prompt)
        self.waiting.append(req)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        while True:
            chunk = await queue.get()
            yield chunk
            if chunk.finished:
                return

    async def _loop(self) -> None:
        await _settle()  # requests submitted together join the same step
        while self.waiting or self.running:
            new, self.waiting = self.waiting, []
            uncached = sum(len(r["prompt"]) - r["cached"] for r in new)
            self.now_s += STEP_S + PER_SEQ_S * len(self.running) + PER_NEW_TOKEN_S * uncached
            for r in new:
                for end in range(BLOCK, len(r["prompt"]) + 1, BLOCK):
                    self.blocks.add(tuple(r["prompt"][:end]))
            for r in self.running + new:
                r["left"] -= 1
                r["out"] += 1
                done = r["left"] == 0
                r["queue"].put_nowait(
                    SimpleNamespace(
                        token_ids=[7],
                        num_output_tokens=r["out"],
                        num_cached_tokens=r["cached"],
                        finished=done,
                        finish_reason="length" if done else "",
                        ttft_s=r.setdefault("ttft_s", self.now_s - r["t0"]),
                    )
                )
            self.running = [r for r in self.running + new if r["left"] > 0]
            await _settle()  # consumers take their chunks, new requests arrive


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


async def test_prefill_pass_measures_each_point_with_its_cached_prefix(engine: FakeEngine) -> None:
    meter = Meter(engine, np.random.default_rng(0), clock=engine.clock)
    grid = Grid(prefill_new_tokens=(64, 300), prefill_cached_points=((256, 100),), repeats=1)
    progress: list[str] = []
    await meter.prefill_pass(grid, progress.append)
    assert progress == ["prefill"] * 3
    samples = {(s.new_tokens, s.cached_tokens): s.seconds for s in meter.prefill_samples()}
    # (256 + 100) tokens after a 256-token prefix: two whole blocks cached, 100 tokens computed.
    assert samples.keys() == {(64, 0), (300, 0), (256, 0), (100, 256)}
    for (new, _), seconds in samples.items():
        assert seconds == pytest.approx(STEP_S + PER_NEW_TOKEN_S * new)


async def test_decode_step_is_the_pure_decode_span_of_the_whole_batch(engine: FakeEngine) -> None:
    meter = Meter(engine, np.random.default_rng(0), clock=engine.clock)
    for batch in (1, 4):
        sample = await meter.decode_step(batch, 200, steps=12)
        assert sample.step_s == pytest.approx(STEP_S + PER_SEQ_S * batch)
        assert sample.batch == batch and 200 * batch < sample.total_context_tokens < 213 * batch
    # The second run reused the first's prompt: it is the first of the four.
    assert meter.decode_prompts(1, 200)[0] == meter.decode_prompts(4, 200)[0]


async def test_measure_runs_every_pass_and_keeps_means(engine: FakeEngine) -> None:
    meter = Meter(engine, np.random.default_rng(0), clock=engine.clock)
    grid = Grid(
        prefill_new_tokens=(64, 128),
        prefill_cached_points=(),
        decode_batches=(1, 2),
        decode_contexts=(128,),
        decode_steps=8,
        repeats=2,
    )
    seen: list[str] = []
    prefill, decode = await meter.measure(grid, seen.append)
    assert seen.count("prefill") == grid.points["prefill"] == 4
    assert seen.count("decode") == grid.points["decode"] == 4
    assert [len(v) for v in meter.prefill_runs.values()] == [2, 2]
    assert [s.step_s for s in decode] == pytest.approx([STEP_S + PER_SEQ_S, STEP_S + 2 * PER_SEQ_S])
    assert [(s.new_tokens, s.cached_tokens) for s in prefill] == [(64, 0), (128, 0)]


async def test_run_workload_is_a_closed_loop_with_exact_outputs(engine: FakeEngine) -> None:
    work = make_workload(7, (50, 150), (3, 9), seed=2)
    seen: list[str] = []
    result = await run_workload(engine, work, 3, np.random.default_rng(0), seen.append, clock=engine.clock)
    assert seen == ["workload"] * 7
    assert {t.request_id: t.output_tokens for t in result.timings} == {
        r.request_id: r.output_tokens for r in work
    }
    assert sorted(t.submit_s for t in result.timings)[:3] == [0.0, 0.0, 0.0]
    assert all(t.submit_s < t.first_token_s <= t.finish_s for t in result.timings)
    assert result.output_tokens_per_s == pytest.approx(sum(r.output_tokens for r in work) / result.makespan_s)


def test_samples_are_the_mean_of_the_runs_stalls_included() -> None:
    meter = Meter(FakeEngine(), np.random.default_rng(0))
    meter.prefill_runs = {(64, 0): [0.1, 0.1, 0.4]}
    meter.decode_runs = {(2, 128): [measure_sample(0.02, 300), measure_sample(0.05, 310)]}
    assert [s.seconds for s in meter.prefill_samples()] == pytest.approx([0.2])
    (d,) = meter.decode_samples()
    assert (d.batch, d.step_s, d.total_context_tokens) == (2, pytest.approx(0.035), pytest.approx(305))


def measure_sample(step_s: float, context: float) -> DecodeSample:
    return DecodeSample(2, context, step_s)

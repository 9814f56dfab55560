"""Replaying a fixed-concurrency workload through the performance model: one request's timeline is the model's
prefill plus its decode steps, and the closed loop replaces each finished request at that moment."""

from __future__ import annotations

import dataclasses

import pytest

from prorsa.calibrate.replay import WorkloadRequest, make_workload, relative_error, replay
from services.runtime import perf_model as pm
from services.runtime.model_profiles import BUILTIN_PROFILES

P = dataclasses.replace(BUILTIN_PROFILES["cpu-tiny"], weight_dense_read_s=0.0, decode_overhead_s=0.01)


def test_one_request_is_its_prefill_then_one_decode_step_per_further_token() -> None:
    result = replay(P, [WorkloadRequest("r", prompt_tokens=500, output_tokens=20)], concurrency=1)
    (t,) = result.timings
    prefill_s = pm.mixed_step_time_s(P, 500, 0, 0)  # one chunk: 500 ≤ mixed_chunk_tokens; samples token 1
    expected_s, context = prefill_s, 501
    for _ in range(19):
        expected_s += pm.decode_step_time_s(P, 1, context)
        context += 1
    assert (t.submit_s, t.output_tokens) == (0.0, 20)
    assert t.first_token_s == pytest.approx(prefill_s)
    assert t.finish_s == pytest.approx(expected_s)
    assert result.output_tokens_per_s == pytest.approx(20 / expected_s)
    assert result.mean_latency_s == pytest.approx(expected_s) and result.mean_ttft_s == pytest.approx(
        prefill_s
    )


def test_closed_loop_keeps_concurrency_requests_in_flight() -> None:
    work = make_workload(12, (100, 600), (5, 40), seed=3)
    result = replay(P, work, concurrency=3)
    timings = sorted(result.timings, key=lambda t: t.submit_s)
    assert sorted(t.request_id for t in timings) == sorted(r.request_id for r in work)
    assert [t.submit_s for t in timings[:3]] == [0.0, 0.0, 0.0]
    finishes = sorted(t.finish_s for t in timings)
    # Every later request starts the moment an earlier one finishes, in finishing order.
    assert [t.submit_s for t in timings[3:]] == pytest.approx(finishes[: len(work) - 3])
    assert {t.request_id: t.output_tokens for t in timings} == {r.request_id: r.output_tokens for r in work}
    assert all(t.submit_s < t.first_token_s <= t.finish_s for t in timings)
    assert result.makespan_s == pytest.approx(finishes[-1])


def test_more_concurrency_raises_throughput_and_latency() -> None:
    work = make_workload(16, (100, 300), (30, 60), seed=1)
    one, four = replay(P, work, 1), replay(P, work, 4)
    assert (
        four.output_tokens_per_s > 1.5 * one.output_tokens_per_s
    )  # batched decode steps are cheaper per token
    assert four.mean_latency_s > one.mean_latency_s


def test_make_workload_is_seeded_and_within_its_ranges() -> None:
    a, b = make_workload(50, (10, 20), (1, 3), seed=7), make_workload(50, (10, 20), (1, 3), seed=7)
    assert a == b and a != make_workload(50, (10, 20), (1, 3), seed=8)
    assert {r.prompt_tokens for r in a} <= set(range(10, 21)) and {r.output_tokens for r in a} == {1, 2, 3}


def test_replay_refuses_an_empty_workload_or_no_concurrency() -> None:
    with pytest.raises(ValueError):
        replay(P, [], 1)
    with pytest.raises(ValueError):
        replay(P, [WorkloadRequest("r", 10, 1)], 0)
    assert relative_error(90.0, 100.0) == pytest.approx(-0.1)

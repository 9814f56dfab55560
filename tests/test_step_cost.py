"""The performance model's fast path (`StepCost`) equals the model (`perf_model`), bit for bit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.runtime import perf_model as pm
from services.runtime.model_profiles import BUILTIN_PROFILES
from services.runtime.step_cost import StepCost, step_cost

PROFILES = sorted(BUILTIN_PROFILES)
profiles = st.sampled_from(PROFILES)
# Batches up to past max_batch (an empty engine admits whatever comes: the tables grow), contexts up to a few
# million tokens (a full batch of long contexts), chunks up to a few local windows, either side of its bends.
batches = st.integers(min_value=0, max_value=1_200)
contexts = st.integers(min_value=0, max_value=4_000_000)
chunks = st.integers(min_value=0, max_value=40_000)
steps = st.integers(min_value=1, max_value=5_000)
PROPERTY = settings(max_examples=400, deadline=None)


@PROPERTY
@given(name=profiles, batch=batches, context=contexts)
def test_decode_step_equals_the_model(name, batch, context):
    p = BUILTIN_PROFILES[name]
    assert StepCost(p).decode_step_s(batch, context) == pm.decode_step_time_s(p, batch, context)


@PROPERTY
@given(name=profiles, batch=batches, context=contexts, n=steps)
def test_decode_jump_ends_are_the_models_step_times(name, batch, context, n):
    p = BUILTIN_PROFILES[name]
    a = pm.decode_step_time_s(p, batch, context)
    last = pm.decode_step_time_s(p, batch, context + (n - 1) * batch)
    assert step_cost(p).jump_s(batch, context, n) == (a, (last - a) / (n - 1) if n > 1 else 0.0)


@PROPERTY
@given(name=profiles, new=chunks, cached=contexts)
def test_prefill_chunk_and_kv_transfer_equal_the_model(name, new, cached):
    p = BUILTIN_PROFILES[name]
    cost = step_cost(p)
    assert cost.prefill_compute_s(new, cached) == pm.prefill_compute_s(p, new, cached)
    assert cost.kv_transfer_s(new) == pm.kv_transfer_time_s(p, new)
    assert cost.kv_transfer_s(cached) == pm.kv_transfer_time_s(p, cached)


@PROPERTY
@given(name=profiles, prefill=chunks, batch=batches, context=contexts, cached=chunks, largest=chunks)
def test_mixed_step_equals_the_model(name, prefill, batch, context, cached, largest):
    p = BUILTIN_PROFILES[name]
    expected = pm.mixed_step_time_s(
        p, prefill, batch, context, prefill_cached_tokens=cached, largest_rank_prefill_tokens=largest
    )
    assert step_cost(p).mixed_step_s(prefill, batch, context, cached, largest) == expected


def test_the_tables_are_built_from_the_model():
    p = BUILTIN_PROFILES["qwen3-235b"]
    cost = StepCost(p)
    assert cost.decode_step_s(p.max_batch + 30, 10_000) == pm.decode_step_time_s(p, p.max_batch + 30, 10_000)
    for batch in (1, 2, p.max_batch, p.max_batch + 30):
        assert cost._fixed[batch] == pm.decode_fixed_s(p, batch)
        assert cost._per_seq[batch] == pm.decode_per_seq_total_s(p, batch)


def test_invalid_inputs_get_the_models_errors():
    cost = StepCost(BUILTIN_PROFILES["qwen3-235b"])
    with pytest.raises(ValueError):
        cost.decode_step_s(-1, 10)
    with pytest.raises(ValueError):
        cost.decode_step_s(4, -10)
    with pytest.raises(ValueError):
        cost.kv_transfer_s(-5)
    with pytest.raises(ValueError):
        cost.mixed_step_s(-1, 4, 100, 0, 0)
    assert cost.decode_step_s(0, 10) == 0.0


@PROPERTY
@given(
    name=profiles,
    chunk_list=st.lists(st.tuples(st.integers(1, 8_192), st.integers(0, 200_000)), min_size=1, max_size=12),
    batch=batches,
    context=contexts,
)
def test_steps_of_chunks_are_the_models(name, chunk_list, batch, context):
    p = BUILTIN_PROFILES[name]
    cost = step_cost(p)
    overhead_and_compute = p.prefill_overhead_s + sum(pm.prefill_compute_s(p, n, c) for n, c in chunk_list)
    assert cost.prefill_step_s(chunk_list) == overhead_and_compute
    total, cached, largest = pm.mixed_step_shape(p, chunk_list)
    assert total == sum(n for n, _ in chunk_list)
    assert max(n for n, _ in chunk_list) <= largest <= total
    if p.dp_ranks == 1:
        assert cached == sum(n * c for n, c in chunk_list) // total
    expected = pm.mixed_step_time_s(
        p, total, batch, context, prefill_cached_tokens=cached, largest_rank_prefill_tokens=largest
    )
    assert cost.mixed_chunks_step_s(chunk_list, batch, context) == expected

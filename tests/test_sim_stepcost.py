"""The simulator's precomputed step costs equal the performance model's, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from prorsa.sim.stepcost import StepCost
from services.runtime import perf_model as pm
from services.runtime.model_profiles import BUILTIN_PROFILES


@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_step_costs_equal_the_model_exactly(name):
    p = BUILTIN_PROFILES[name]
    cost = StepCost(p)
    rng = np.random.default_rng(7)
    for batch, context in zip(
        rng.integers(0, p.max_batch + 40, 3_000).tolist(),
        rng.integers(0, 4_000_000, 3_000).tolist(),
        strict=True,
    ):
        assert cost.decode_step_s(batch, context) == pm.decode_step_time_s(p, batch, context)
        steps = 1 + context % 700
        a = pm.decode_step_time_s(p, batch, context)
        last = pm.decode_step_time_s(p, batch, context + (steps - 1) * batch)
        assert cost.jump_s(batch, context, steps) == (a, (last - a) / (steps - 1) if steps > 1 else 0.0)
    window = max(p.attn_local_window_tokens, 1)
    for new, cached in zip(
        rng.integers(0, 3 * window, 3_000).tolist(), rng.integers(0, 3 * window, 3_000).tolist(), strict=True
    ):
        assert cost.prefill_compute_s(new, cached) == pm.prefill_compute_s(p, new, cached)
        assert cost.kv_transfer_s(new) == pm.kv_transfer_time_s(p, new)
    for prefill, batch, context, cached, largest in rng.integers(0, 3 * window, (2_000, 5)).tolist():
        batch %= p.max_batch + 1
        expected = pm.mixed_step_time_s(
            p, prefill, batch, context, prefill_cached_tokens=cached, largest_rank_prefill_tokens=largest
        )
        assert cost.mixed_step_s(prefill, batch, context, cached, largest) == expected


def test_invalid_inputs_get_the_models_errors():
    cost = StepCost(BUILTIN_PROFILES["qwen3-235b"])
    with pytest.raises(ValueError):
        cost.decode_step_s(-1, 10)
    with pytest.raises(ValueError):
        cost.kv_transfer_s(-5)
    assert cost.decode_step_s(0, 10) == 0.0

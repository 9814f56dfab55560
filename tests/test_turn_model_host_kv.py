"""The allocator's turn model with a host KV tier: colocation's capacity misses that host memory holds cost a
reload, not a recompute; a split's pricing and everything without the tier stay as they were."""

from __future__ import annotations

import pytest

from services.allocator.capacity import CapacityModel
from services.allocator.policies.common import Split
from services.allocator.policies.turn_model import (
    TurnShape,
    cache_hit_share,
    host_reload_stall_s,
    host_tier_share,
    turn_time,
)
from services.runtime import perf_model as pm
from services.runtime.host_kv import with_host_kv
from services.runtime.model_profiles import load_profile

QWEN = load_profile("qwen3-235b")
TIERED = with_host_kv(QWEN, 2.0)
# The cell: 512 agent trajectories on 8 engines, 30–50k tokens of context each.
AGENT = TurnShape(new_tokens=1_500, output_tokens=400, context_tokens=40_000, tool_s=3.0)


def test_the_host_tier_holds_what_its_capacity_covers_beyond_the_device() -> None:
    assert host_tier_share(QWEN, 3e6, 0.4) == 0.0  # no tier
    working = 64 * 41_000  # 64 trajectories homed on one engine
    kept = cache_hit_share(1.2e6, working)
    assert host_tier_share(TIERED, working, kept) == pytest.approx(
        1.0 - kept
    )  # 3.9M host tokens hold them all
    kept = cache_hit_share(1.2e6, 4 * working)  # four times as many: the host tier too holds only a share
    assert host_tier_share(TIERED, 4 * working, kept) == pytest.approx(
        TIERED.host_kv_tokens / (4 * working) - kept
    )
    assert host_tier_share(TIERED, 1e5, 1.0) == 0.0  # the GPUs hold everything: nothing to reload


def test_a_reload_stalls_only_what_outlasts_the_step_it_overlaps() -> None:
    load = pm.host_reload_time_s(TIERED, 40_000)
    assert host_reload_stall_s(TIERED, 40_000, 0.0) == pytest.approx(load)
    assert host_reload_stall_s(TIERED, 40_000, load / 2) == pytest.approx(load / 2)
    assert host_reload_stall_s(TIERED, 40_000, 2 * load) == 0.0
    assert host_reload_stall_s(QWEN, 40_000, 0.0) == 0.0


def test_the_tier_shortens_colocations_turn_at_high_concurrency_and_not_a_splits() -> None:
    off, on = CapacityModel(QWEN), CapacityModel(TIERED)
    colocated = Split(0, 0, 8)
    plain, tiered = turn_time(colocated, AGENT, 512, off), turn_time(colocated, AGENT, 512, on)
    assert tiered.prefill_s < 0.8 * plain.prefill_s and tiered.turn_s < plain.turn_s
    # A split's misses are turns sent to another engine, whose host memory does not hold them either.
    assert turn_time(Split(4, 4), AGENT, 512, on) == turn_time(Split(4, 4), AGENT, 512, off)


def test_where_the_gpus_hold_every_prefix_the_tier_prices_nothing() -> None:
    off, on = CapacityModel(QWEN), CapacityModel(TIERED)
    for n in (8, 32):  # a few trajectories per engine: their prefixes fit the device KV
        assert turn_time(Split(0, 0, 8), AGENT, n, on) == turn_time(Split(0, 0, 8), AGENT, n, off)

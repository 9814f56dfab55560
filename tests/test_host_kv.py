"""The host KV tier as an engine option (services/runtime/host_kv.py) and its reload times in the performance
model: size from HiCache's ratio, bandwidth from the GPUs' PCIe links, a DP rank's share per request, overlap."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from services.runtime import perf_model as pm
from services.runtime.host_kv import HICACHE_DEFAULT_RATIO, PCIE_H2D_BYTES_PER_S_PER_GPU, with_host_kv
from services.runtime.model_profiles import BUILTIN_PROFILES, load_profile, profile_from_json, profile_to_json

QWEN = load_profile("qwen3-235b")  # TP8: a request's KV on all 8 GPUs
DEEPSEEK = load_profile("deepseek-v3.2")  # DP8 attention: a request's KV on one rank's GPU


def test_off_is_the_profile_itself_and_no_builtin_has_a_tier() -> None:
    assert with_host_kv(QWEN, 0.0) is QWEN
    assert all(p.host_kv_tokens == 0 for p in BUILTIN_PROFILES.values())


def test_hicache_default_ratio_doubles_the_device_kv_over_every_gpu_link() -> None:
    p = with_host_kv(QWEN, HICACHE_DEFAULT_RATIO)
    assert HICACHE_DEFAULT_RATIO == 2.0
    assert p.host_kv_tokens == int(2 * QWEN.kv_capacity_tokens)
    assert p.host_kv_load_bytes_per_s == 8 * PCIE_H2D_BYTES_PER_S_PER_GPU == 440e9
    assert p.kv_capacity_tokens == QWEN.kv_capacity_tokens  # the device tier does not move
    assert with_host_kv(QWEN, 3.0, load_bytes_per_s=1e9).host_kv_load_bytes_per_s == 1e9


@pytest.mark.parametrize("ratio", [-1.0, 0.5, 1.0, math.nan])
def test_a_host_pool_no_larger_than_the_device_pool_is_refused(ratio: float) -> None:
    with pytest.raises(ValueError, match="ratio"):
        with_host_kv(QWEN, ratio)


def test_a_cpu_engine_has_no_host_tier_and_a_tier_needs_a_bandwidth() -> None:
    with pytest.raises(ValueError, match="CPU"):
        with_host_kv(load_profile("cpu-tiny"), 2.0)
    with pytest.raises(ValueError, match="host_kv_load_bytes_per_s"):
        replace(QWEN, host_kv_tokens=1_000)


def test_the_tier_round_trips_through_a_profile_file() -> None:
    p = with_host_kv(DEEPSEEK, 2.0)
    assert profile_from_json(profile_to_json(p)) == p
    base = {"schema": "prorsa.model_profile", "schema_version": 1, "base": "deepseek-v3.2"}
    assert profile_from_json(base).host_kv_tokens == 0  # files that predate the fields: no tier


def test_a_reload_moves_a_handoffs_bytes_over_the_requests_rank_links() -> None:
    tp, dp = with_host_kv(QWEN, 2.0), with_host_kv(DEEPSEEK, 2.0)
    # qwen3-235b, 40k tokens: 40k × 385,024 B over 8 × 55 GB/s = 35 ms (against ~1.3 s to recompute them).
    assert pm.host_reload_time_s(tp, 40_000) == pytest.approx(40_000 * 385_024 / 440e9)
    assert pm.host_reload_time_s(tp, 40_000) < pm.prefill_time_s(tp, 40_000) / 30
    # deepseek-v3.2: the request lives on one DP rank, one GPU: its link alone.
    assert pm.host_reload_time_s(dp, 40_000) == pytest.approx(40_000 * 78_324 / 55e9)
    assert pm.host_reload_time_s(tp, 0) == 0.0
    with pytest.raises(ValueError, match="no host KV tier"):
        pm.host_reload_time_s(QWEN, 10)


def test_a_steps_reloads_share_the_links_as_its_requests_share_the_ranks() -> None:
    tp, dp = with_host_kv(QWEN, 2.0), with_host_kv(DEEPSEEK, 2.0)
    one = pm.host_reload_time_s
    # One rank: the loads queue on the same links.
    assert pm.host_reload_step_s(tp, [10_000, 30_000]) == pytest.approx(one(tp, 40_000))
    # DP ranks load in parallel: the largest request's rank sets the time, unless all of them outweigh it.
    assert pm.host_reload_step_s(dp, [10_000, 30_000]) == pytest.approx(one(dp, 30_000))
    assert pm.host_reload_step_s(dp, [10_000] * 16) == pytest.approx(one(dp, 10_000) * 2)
    assert pm.host_reload_step_s(dp, [0, 0]) == 0.0 and pm.host_reload_step_s(QWEN, []) == 0.0

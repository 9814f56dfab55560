"""Properties of the engine performance model and its profiles."""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.runtime import perf_model as pm
from services.runtime.model_profiles import (
    BUILTIN_PROFILES,
    load_profile,
    profile_from_json,
    profile_to_json,
)

PROFILES = list(BUILTIN_PROFILES.values())
profiles = st.sampled_from(PROFILES)
tokens = st.integers(min_value=0, max_value=200_000)
positive_tokens = st.integers(min_value=1, max_value=200_000)
batches = st.integers(min_value=1, max_value=1024)

FAST = settings(max_examples=100, deadline=None)


@FAST
@given(profiles, positive_tokens, tokens, st.integers(min_value=1, max_value=10_000))
def test_prefill_monotonic_in_new_tokens(p, new, cached, extra):
    assert pm.prefill_time_s(p, new + extra, cached) > pm.prefill_time_s(p, new, cached)


@FAST
@given(profiles, positive_tokens, tokens, st.integers(min_value=1, max_value=100_000))
def test_prefill_monotonic_in_cached_tokens(p, new, cached, extra):
    assert pm.prefill_time_s(p, new, cached + extra) >= pm.prefill_time_s(p, new, cached)


@FAST
@given(profiles, positive_tokens, tokens)
def test_a_cache_hit_never_costs_more_than_computing_it(p, new, cached):
    assert pm.prefill_time_s(p, new, cached) <= pm.prefill_time_s(p, new + cached, 0)


def test_a_long_cache_hit_is_much_cheaper_than_recomputing():
    p = BUILTIN_PROFILES["qwen3-235b"]
    assert pm.prefill_time_s(p, 200, 19_000) * 10 < pm.prefill_time_s(p, 19_200, 0)


@FAST
@given(profiles, batches, tokens, st.integers(min_value=1, max_value=64))
def test_decode_step_monotonic_in_batch(p, batch, context, extra):
    assert pm.decode_step_time_s(p, batch + extra, context) > pm.decode_step_time_s(p, batch, context)


@FAST
@given(profiles, batches, tokens, st.integers(min_value=1, max_value=1_000_000))
def test_decode_step_monotonic_in_context(p, batch, context, extra):
    assert pm.decode_step_time_s(p, batch, context + extra) >= pm.decode_step_time_s(p, batch, context)


def test_decode_step_grows_with_context_for_full_attention():
    p = BUILTIN_PROFILES["qwen3-235b"]
    assert pm.decode_step_time_s(p, 64, 64 * 32_000) > 1.5 * pm.decode_step_time_s(p, 64, 64 * 1_000)


@FAST
@given(profiles, tokens, st.integers(min_value=0, max_value=1024), tokens, tokens)
def test_mixed_step_at_least_the_decode_step(p, prefill, batch, context, cached):
    mixed = pm.mixed_step_time_s(p, prefill, batch, context, prefill_cached_tokens=cached)
    assert mixed >= pm.decode_step_time_s(p, batch, context)
    if prefill > 0 and batch > 0:
        assert mixed > pm.decode_step_time_s(p, batch, context)


@FAST
@given(profiles, tokens, st.integers(min_value=1, max_value=10_000), batches, tokens)
def test_mixed_step_monotonic_in_prefill_tokens(p, prefill, extra, batch, context):
    assert pm.mixed_step_time_s(p, prefill + extra, batch, context) >= pm.mixed_step_time_s(
        p, prefill, batch, context
    )


def test_dp_attention_stall_matches_the_reported_interference():
    # vllm pull 44558: P50 ITL 274.9 ms with a prefill in the step vs 32.1 ms without (1k-token prompts).
    p = BUILTIN_PROFILES["deepseek-v3.2"]
    decode = pm.decode_step_time_s(p, 64, 64 * 1_200)
    mixed = pm.mixed_step_time_s(p, 1_000, 64, 64 * 1_200)
    assert 5 < mixed / decode < 15
    # A TP engine computes the same prefill over all its GPUs: a much smaller penalty.
    q = BUILTIN_PROFILES["qwen3-235b"]
    assert pm.mixed_step_time_s(q, 1_000, 64, 64 * 1_200) / pm.decode_step_time_s(q, 64, 64 * 1_200) < 3


def test_dp_stall_spreads_large_prefills_over_ranks():
    p = BUILTIN_PROFILES["deepseek-v3.2"]
    assert pm.slowest_rank_prefill_tokens(p, 1_000) == 1_000  # one request lives on one rank
    assert pm.slowest_rank_prefill_tokens(p, 8 * 4_096) == 4_096
    assert pm.slowest_rank_prefill_tokens(BUILTIN_PROFILES["qwen3-235b"], 5_000) == 5_000


@FAST
@given(profiles, tokens, st.integers(min_value=1, max_value=100_000))
def test_kv_transfer_monotonic(p, n, extra):
    assert pm.kv_transfer_time_s(p, n + extra) > pm.kv_transfer_time_s(p, n)


def test_kv_transfer_of_nothing_is_free_and_mooncake_figure_is_reproduced():
    p = BUILTIN_PROFILES["qwen3-235b"]
    assert pm.kv_transfer_time_s(p, 0) == 0.0
    # Mooncake: 12.62 GB for a 32K prompt in 76.8 ms.
    assert pm.kv_transfer_time_s(p, 32_768) == pytest.approx(0.0768 + p.kv_transfer_latency_s, rel=0.05)


def test_sliding_window_profile_has_small_kv_reads():
    mimo, qwen = BUILTIN_PROFILES["mimo-v2.5-pro"], BUILTIN_PROFILES["qwen3-235b"]
    grow_mimo = pm.decode_step_time_s(mimo, 32, 32 * 64_000) - pm.decode_step_time_s(mimo, 32, 32 * 1_000)
    grow_qwen = pm.decode_step_time_s(qwen, 32, 32 * 64_000) - pm.decode_step_time_s(qwen, 32, 32 * 1_000)
    assert grow_mimo * 5 < grow_qwen


def test_attention_pairs_closed_form_matches_a_sum():
    for new, cached, window in [(5, 0, 3), (7, 4, 3), (10, 10, 100), (3, 2, 1)]:
        brute = sum(min(i, window) for i in range(cached, cached + new))
        assert pm.attention_pairs(new, cached, window) == brute
        assert pm.attention_pairs(new, cached) == sum(range(cached, cached + new))


def test_negative_inputs_are_rejected():
    p = PROFILES[0]
    with pytest.raises(ValueError):
        pm.prefill_time_s(p, -1, 0)
    with pytest.raises(ValueError):
        pm.decode_step_time_s(p, -1, 0)
    with pytest.raises(ValueError):
        pm.kv_transfer_time_s(p, -5)
    assert pm.decode_step_time_s(p, 0, 0) == 0.0


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_profiles_round_trip_through_json(profile, tmp_path):
    data = json.loads(json.dumps(profile_to_json(profile)))
    assert profile_from_json(data) == profile
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert load_profile(str(path)) == profile
    assert load_profile(profile.name) is profile
    assert pm.kv_capacity_tokens(profile) == profile.kv_capacity_tokens > 0
    assert pm.role_switch_time_s(profile) == profile.role_switch_s


def test_calibration_file_with_a_base_overrides_fitted_fields(tmp_path):
    fitted = {
        "schema": "prorsa.model_profile",
        "schema_version": 1,
        "base": "cpu-tiny",
        "name": "my-cpu",
        "prefill_tokens_per_s": 12_345,
        "decode_per_seq_s": 0.0005,
    }
    p = profile_from_json(fitted)
    assert p == replace(
        BUILTIN_PROFILES["cpu-tiny"], name="my-cpu", prefill_tokens_per_s=12_345.0, decode_per_seq_s=0.0005
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schema": "other"}, "schema"),
        ({"schema_version": 2}, "schema_version"),
        ({"prefil_tokens_per_s": 1.0}, "unknown"),
        ({"max_batch": "many"}, "max_batch"),
        ({"max_batch": 1.5}, "max_batch"),
        ({"prefill_tokens_per_s": -3.0}, "prefill_tokens_per_s"),
        ({"base": "nope"}, "base"),
    ],
)
def test_bad_profile_json_is_rejected_with_the_key(change, message):
    data = profile_to_json(BUILTIN_PROFILES["qwen3-235b"]) | change
    with pytest.raises(ValueError, match=message):
        profile_from_json(data)


def test_missing_fields_without_base_are_named():
    data = profile_to_json(BUILTIN_PROFILES["qwen3-235b"])
    del data["max_batch"]
    with pytest.raises(ValueError, match="max_batch"):
        profile_from_json(data)


def test_unknown_profile_name(tmp_path):
    with pytest.raises(ValueError, match="qwen3-235b"):
        load_profile("gpt-17")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(str(bad))


@pytest.mark.parametrize(
    "path",
    [
        "services/runtime/perf_model.py",
        "services/runtime/model_profiles.py",
        "services/engine_agent/prefix_cache.py",
        "services/allocator/policy.py",
    ],
)
def test_pure_cores_import_no_clock_randomness_or_io_loop(path):
    tree = ast.parse((Path(__file__).parent.parent / path).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"asyncio", "nats", "time", "random"}

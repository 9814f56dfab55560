"""The engine core with a host KV tier: a prompt whose prefix the GPUs evicted reloads it instead of recomputing
it, in a step that lasts the longer of its compute and the load; with nothing evicted the tier changes nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.engine_agent.engine_core import CoreSeq
from services.engine_agent.solo_engine import SoloEngine
from services.runtime import perf_model as pm
from services.runtime.host_kv import with_host_kv
from services.runtime.model_profiles import load_profile

# qwen3-235b with a device KV of 100k tokens, so two 60k-token prefixes overflow it.
SMALL = replace(load_profile("qwen3-235b"), kv_capacity_tokens=100_000)


def run_idle(engine: SoloEngine) -> None:
    while (t := engine.next_event_s()) is not None:
        engine.advance(t)


def second_turn(profile: pm.ModelProfile, role: str) -> tuple[CoreSeq, float]:
    """Trajectory a (60k), then b (60k: a leaves the GPUs), then a's next turn (60.2k); its seq and prefill time."""
    engine = SoloEngine(profile, role)
    remote = role == "prefill"
    for rid, key in ((1, "a"), (2, "b")):
        engine.submit(CoreSeq(rid, key, 60_000, 1, remote=remote))
        run_idle(engine)
    assert engine.cache.lookup("a", 60_200) == 0  # evicted from the device
    start = engine.now
    seq = CoreSeq(3, "a", 60_200, 1, remote=remote)
    engine.submit(seq)
    run_idle(engine)
    prefilled = [at for s, at in engine.prefilled if s is seq]
    return seq, prefilled[0] - start


@pytest.mark.parametrize("role", ["prefill", "mixed"])
def test_a_host_hit_reloads_the_prefix_in_the_step_that_computes_the_new_tokens(role: str) -> None:
    tiered = with_host_kv(SMALL, 2.0)
    seq, took = second_turn(tiered, role)
    held = 60_000 if role == "prefill" else 60_001  # a mixed engine also caches the answer it decoded
    assert (seq.hit_tokens, seq.reload_tokens) == (held, held)
    compute = pm.prefill_time_s(tiered, 60_200 - held, held)
    load = pm.host_reload_time_s(tiered, held)  # 52 ms: longer than the step, so it sets the step's length
    assert load > compute
    assert took == pytest.approx(load, rel=1e-12)
    # Without the tier the same turn recomputes 60.2k tokens: over 20 times as long.
    plain, recomputed = second_turn(SMALL, role)
    assert (plain.hit_tokens, plain.reload_tokens) == (0, 0)
    assert recomputed > 20 * took


def test_a_reload_shorter_than_the_step_is_hidden_by_it() -> None:
    fast = with_host_kv(SMALL, 2.0, load_bytes_per_s=1e14)  # layer-wise overlap: the load fits in the compute
    seq, took = second_turn(fast, "prefill")
    assert seq.reload_tokens == 60_000
    assert took == pytest.approx(pm.prefill_time_s(fast, 200, 60_000), rel=1e-12)


def test_a_prefix_the_host_tier_evicted_too_is_recomputed() -> None:
    small_host = replace(SMALL, host_kv_tokens=70_000, host_kv_load_bytes_per_s=440e9)  # one prefix, not two
    seq, took = second_turn(small_host, "prefill")
    assert (seq.hit_tokens, seq.reload_tokens) == (0, 0)  # b pushed a out of host memory as well
    _, recomputed = second_turn(SMALL, "prefill")
    assert took == recomputed


@pytest.mark.parametrize("role", ["prefill", "mixed"])
def test_with_nothing_evicted_the_tier_changes_nothing(role: str) -> None:
    """Every turn fits the GPUs: the same hits and the same times, to the bit, with the tier as without it."""

    def times(profile: pm.ModelProfile) -> list[tuple[int, int, float]]:
        engine = SoloEngine(profile, role)
        out = []
        for turn in range(4):
            for k, key in enumerate("abc"):
                seq = CoreSeq(turn * 3 + k, key, 5_000 * (turn + 1), 30, remote=role == "prefill")
                engine.submit(seq)
                run_idle(engine)
                out.append((seq.hit_tokens, seq.reload_tokens, engine.now))
        return out

    assert times(with_host_kv(SMALL, 2.0)) == times(SMALL)

"""The engine core's own rules, driven through `SoloEngine` (the simulator's and the live backend's tests drive
the same core through their shells): where a prefilled prompt goes, the first token at prefill, the steps of a
decode jump out by a given time, and what a role change keeps."""

from __future__ import annotations

import pytest

from services.engine_agent.engine_core import JUMP, CoreSeq
from services.engine_agent.solo_engine import SoloEngine
from services.runtime import perf_model as pm
from services.runtime.model_profiles import load_profile

P = load_profile("qwen3-235b")


def run_idle(engine: SoloEngine) -> None:
    while (t := engine.next_event_s()) is not None:
        engine.advance(t)


def test_a_remote_prompt_on_a_mixed_engine_is_handed_off_and_frees_its_kv() -> None:
    engine = SoloEngine(P, "mixed")
    local, remote = CoreSeq(1, "a", 2_000, 50), CoreSeq(2, "b", 2_000, 50, remote=True)
    engine.submit(local)
    engine.submit(remote)
    run_idle(engine)
    assert [s for s, _ in engine.handed_off] == [remote]
    assert [s for s, _ in engine.finished] == [local]
    assert engine.kv_reserved == 0 and remote.engine is None


@pytest.mark.parametrize("role", ["mixed", "prefill"])
def test_a_one_token_turn_ends_at_its_prefill(role: str) -> None:
    engine = SoloEngine(P, role)
    seq = CoreSeq(1, "a", 3_000, 1)
    engine.submit(seq)
    run_idle(engine)
    (done, at), (prefilled, at_prefill) = engine.finished[0], engine.prefilled[0]
    assert done is seq is prefilled and at == at_prefill == pytest.approx(pm.prefill_time_s(P, 3_000, 0))
    assert not engine.handed_off and engine.steps_done == 0 and engine.kv_reserved == 0


def test_a_turn_decodes_one_step_fewer_than_its_output() -> None:
    engine = SoloEngine(P, "decode")
    seq = CoreSeq(1, "a", 1_000, 40)
    engine.receive(seq)
    run_idle(engine)
    assert engine.steps_done == 39  # the prefill engine sampled the first token
    arrive = pm.kv_transfer_time_s(P, 1_000)
    steps = sum(pm.decode_step_time_s(P, 1, 1_001 + i) for i in range(39))
    assert engine.finished[0][1] == pytest.approx(arrive + steps, rel=1e-9)


def test_steps_at_counts_the_jumps_steps_done_by_then() -> None:
    engine = SoloEngine(P, "decode")
    engine.receive(CoreSeq(1, "a", 1_000, 500))
    start = pm.kv_transfer_time_s(P, 1_000)
    engine.advance(start)
    assert engine.activity == JUMP
    ends = [start]
    for i in range(10):
        ends.append(ends[-1] + pm.decode_step_time_s(P, 1, 1_001 + i))
    for k in range(1, 10):
        assert engine.steps_at(ends[k]) == k
        assert engine.steps_at((ends[k] + ends[k + 1]) / 2) == k  # the next step is not out yet


def test_a_role_change_in_place_keeps_the_prefix_cache_until_decodes_need_its_kv() -> None:
    engine = SoloEngine(P, "mixed")
    engine.submit(CoreSeq(1, "traj", 4_000, 2))
    run_idle(engine)
    assert engine.cache.cached_tokens("traj") == 4_002
    engine.set_role("prefill")
    assert engine.cache.cached_tokens("traj") == 4_002
    engine.set_role("decode")  # one KV layout for every role: nothing restarts, nothing is thrown away
    assert engine.cache.cached_tokens("traj") == 4_002
    # Decodes that take the whole KV evict it, as vLLM reuses free blocks.
    engine.receive(CoreSeq(2, "big", P.kv_capacity_tokens - 1_000, 100))
    assert engine.cache.cached_tokens("traj") == 0


def test_a_decode_engine_that_becomes_prefill_finishes_its_decodes_while_it_prefills() -> None:
    """Switched in place, it holds both kinds of work: its prefill steps carry the decodes along until they are
    done, each finishing here; the new prompt's KV goes to a decode engine (it is remote: pulled as prefill work).
    A step with riders costs the prompt's compute plus their decode step."""
    engine = SoloEngine(P, "decode")
    decodes = [CoreSeq(i, f"d{i}", 2_000, 400) for i in range(3)]
    for seq in decodes:
        engine.receive(seq)
    engine.advance(0.5)
    assert engine.activity == JUMP and engine.steps_at(engine.now) > 0
    engine.set_role("prefill")
    prompt = CoreSeq(9, "p", 6_000, 50, remote=True)
    engine.submit(prompt)
    run_idle(engine)
    assert [s for s, _ in engine.handed_off] == [prompt]
    assert sorted(s.rid for s, _ in engine.finished) == [0, 1, 2]  # none left, none moved
    assert engine.steps_done == 399 and engine.kv_reserved == 0
    handed_at = engine.handed_off[0][1]
    assert handed_at < max(t for _, t in engine.finished)  # the prompt did not wait for the decodes to end
    alone = pm.prefill_time_s(P, 6_000, 0)
    assert (
        alone - P.prefill_overhead_s < handed_at - 0.5 < alone + 0.2
    )  # its compute plus the riders' decode step


def test_a_prefill_engine_that_becomes_decode_finishes_the_prompts_it_holds() -> None:
    engine = SoloEngine(P, "prefill")
    prompts = [CoreSeq(i, f"p{i}", 20_000, 50, remote=True) for i in range(3)]
    for seq in prompts:
        engine.submit(seq)
    engine.set_role("decode")  # before the first step ends: all three are held, one started
    run_idle(engine)
    assert [s for s, _ in engine.handed_off] == prompts  # prefilled here and handed on, as pulled
    assert not engine.finished and engine.kv_reserved == 0


def test_a_mixed_engine_that_becomes_decode_decodes_its_own_requests_to_the_end() -> None:
    engine = SoloEngine(P, "mixed")
    local = [CoreSeq(i, f"m{i}", 3_000, 300) for i in range(2)]
    for seq in local:
        engine.submit(seq)
    engine.advance(0.5)
    engine.set_role("decode")
    run_idle(engine)
    assert sorted(s.rid for s, _ in engine.finished) == [0, 1] and not engine.handed_off
    assert engine.kv_reserved == 0

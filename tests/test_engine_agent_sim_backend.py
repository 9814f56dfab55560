"""The simulated backend: the engine core under it charges exactly the performance model, its tokens are a pure
function of the request, and the async shell keeps streams consistent across prefill/decode and migration."""

from __future__ import annotations

import asyncio
import math
import time

import msgspec
import pytest

from proto import DecodeHandoff, GenerateRequest, SamplingParams
from services.engine_agent.backend import Backend, KvUnavailable
from services.engine_agent.backends.sim_backend import LiveSeq, SimBackend, output_end
from services.engine_agent.backends.sim_tokens import SimTokens
from services.engine_agent.engine_core import JUMP, MIXED_STEP
from services.engine_agent.solo_engine import SoloEngine
from services.runtime import perf_model as pm
from services.runtime.model_profiles import load_profile

P = load_profile("qwen3-235b")


def req(rid: str, max_tokens: int = 20, prompt_len: int = 2_000, **fields: object) -> GenerateRequest:
    fields.setdefault("traj_id", f"t-{rid}")
    return GenerateRequest(
        request_id=rid,
        turn=0,
        prompt_token_ids=[],
        prompt_len=prompt_len,
        sampling=SamplingParams(max_tokens=max_tokens),
        reply_to="r",
        **fields,  # type: ignore[arg-type]
    )


def seq(rid: str, mode: str, prompt: int, max_tokens: int, traj: str = "", cacheable: int = 0) -> LiveSeq:
    r = req(rid, max_tokens, prompt, traj_id=traj or f"t-{rid}", sim_cacheable_tokens=cacheable)
    return LiveSeq(hash(rid) % 1_000_000, r, mode, 131_072, 1_000)  # type: ignore[arg-type]


def test_tokens_are_a_pure_function_of_request_and_position() -> None:
    a, b = SimTokens("r-1"), SimTokens("r-1")
    forward = [a.at(i) for i in range(600)]
    backward = [b.at(i) for i in reversed(range(600))][::-1]
    assert forward == backward
    assert [t for t, _ in forward] != [SimTokens("r-2").at(i)[0] for i in range(600)]
    assert all(lp < 0 for _, lp in forward)


@pytest.mark.parametrize(
    ("max_tokens", "sim_out", "prompt", "model_len", "expected"),
    [
        (100, 0, 1_000, 10_000, (100, "length")),
        (100, 40, 1_000, 10_000, (40, "stop")),
        (100, 400, 1_000, 10_000, (100, "length")),
        (100, 0, 9_950, 10_000, (50, "length")),  # the model length caps it
    ],
)
def test_output_end(max_tokens: int, sim_out: int, prompt: int, model_len: int, expected: tuple) -> None:
    assert output_end(req("x", max_tokens, prompt, sim_output_tokens=sim_out), model_len) == expected


@pytest.mark.parametrize(
    ("max_tokens", "sim_out", "min_tokens", "expected"),
    [
        (100, 40, 60, (60, "stop")),  # min_tokens holds the stop back
        (100, 40, 10, (40, "stop")),  # already longer: unchanged
        (100, 40, 500, (100, "length")),  # never past max_tokens
    ],
)
def test_min_tokens_bounds_the_output(
    max_tokens: int, sim_out: int, min_tokens: int, expected: tuple
) -> None:
    r = req("x", max_tokens, 1_000, sim_output_tokens=sim_out)
    r = msgspec.structs.replace(r, sampling=SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens))
    assert output_end(r, 10_000) == expected


def test_top_logprobs_are_k_deterministic_alternatives_holding_the_sampled_token() -> None:
    tokens = SimTokens("r-top", vocab_size=1_000)
    for pos in range(300):
        top = tokens.top(pos, 5)
        assert top == SimTokens("r-top", vocab_size=1_000).top(pos, 5)
        ids = [t for t, _ in top]
        lps = [lp for _, lp in top]
        assert len(top) == 5 and len(set(ids)) == 5 and lps == sorted(lps, reverse=True)
        assert sum(math.exp(lp) for lp in lps) <= 1.0 + 1e-9
        sampled, lp = tokens.at(pos)
        # The sampled token is listed with its own logprob exactly when it ranks within the 5.
        assert ((sampled, lp) in top) == (lp >= lps[-1])
    assert tokens.top(0, 0) == [] and tokens.top(0, 1) != SimTokens("r-other", vocab_size=1_000).top(0, 1)


def test_the_core_charges_the_performance_model() -> None:
    s = SoloEngine(P, "prefill")
    a = seq("a", "prefill", 3_000, 10)
    s.submit(a)
    assert s.next_event_s() == pytest.approx(pm.prefill_time_s(P, 3_000, 0))
    s.advance(1.0)
    assert [q for q, _ in s.handed_off] == [a] and s.cache.cached_tokens("t-a") == 3_000
    # Decode: two sequences whose KV arrived step together; each carries the token its prefill sampled.
    d = SoloEngine(P, "decode")
    for rid in ("b", "c"):
        d.receive(seq(rid, "decode", 1_000, 50))
    d.advance(pm.kv_transfer_time_s(P, 1_000))
    assert d.activity == JUMP and d._jump_steps == 49
    assert d._jump_a == pytest.approx(pm.decode_step_time_s(P, 2, 2_002))
    assert d._jump_a + d._jump_b == pytest.approx(pm.decode_step_time_s(P, 2, 2_004))


def test_mixed_steps_chunk_prefill_and_carry_the_decode_batch() -> None:
    s = SoloEngine(P, "mixed")
    dec = seq("dec", "decode", 4_000, 30)
    s.receive(dec)
    s.advance(pm.kv_transfer_time_s(P, 4_000))  # joined: a decode jump starts
    long = seq("long", "generate", 20_000, 5)
    s.submit(long)  # the jump had not made a step yet: a step with a chunk and the batch replaces it at once
    assert s.activity == MIXED_STEP and s._chunks == [(long, P.mixed_chunk_tokens)]
    context = 4_001 + s.steps_done
    expected = pm.mixed_step_time_s(P, P.mixed_chunk_tokens, 1, context, prefill_cached_tokens=0)
    assert s.next_event_s() == pytest.approx(s.now + expected)


def test_prefix_hits_are_bounded_and_the_last_token_recomputed() -> None:
    s = SoloEngine(P, "mixed")
    s.cache.insert("traj", 5_000, 0.0)
    for rid, context, cacheable, hit in [
        ("a", 5_300, 0, 5_000),
        ("b", 5_300, 4_000, 4_000),
        ("c", 3_000, 0, 2_999),
    ]:
        q = seq(rid, "generate", context, 5, traj="traj", cacheable=cacheable)
        s.submit(q)
        assert (q.hit_tokens, q.to_compute_tokens) == (hit, context - hit)
        s.drop(q)
        s.advance(s.next_event_s() or 0.0)
    assert s.kv_reserved == 0


async def test_prefill_decode_and_migration_continue_one_token_sequence() -> None:
    b = SimBackend(P, "e0", speedup=200.0)
    assert isinstance(b, Backend)
    await b.start()
    try:
        whole = [t for c in [c async for c in b.generate(req("r", 40))] for t in c.token_ids]
        assert whole == [SimTokens("r").at(i)[0] for i in range(40)]
        res = await b.prefill(req("r", 40))
        assert res.first_token_id == whole[0] and not res.finished and res.kv_transfer_params is not None
        handoff = DecodeHandoff(
            request=req("r", 40),
            prefill_engine="e0",
            first_token_id=res.first_token_id,
            kv_transfer_params=res.kv_transfer_params,
        )
        rest = [t for c in [c async for c in b.decode(handoff)] for t in c.token_ids]
        assert [res.first_token_id, *rest] == whole
        resumed = msgspec.structs.replace(req("r", 40), resume_token_ids=whole[:15])
        tail = [c async for c in b.generate(resumed)]
        assert whole[:15] + [t for c in tail for t in c.token_ids] == whole
        assert tail[0].prefill is not None and tail[-1].finished and tail[-1].finish_reason == "length"
        assert b.stats().running == 0 and b.core.kv_reserved == 0
    finally:
        await b.close()


async def test_top_logprobs_follow_every_token_through_prefill_and_decode() -> None:
    b = SimBackend(P, "e0", speedup=200.0)
    await b.start()
    try:
        r = msgspec.structs.replace(req("rk", 30), sampling=SamplingParams(max_tokens=30, top_logprobs=3))
        tokens = SimTokens("rk")
        chunks = [c async for c in b.generate(r)]
        tops = [t for c in chunks for t in (c.top_logprobs or [])]
        assert tops == [tokens.top(i, 3) for i in range(30)]
        assert sum(len(c.token_ids) for c in chunks) == 30
        res = await b.prefill(r)
        assert res.first_top_logprobs == tokens.top(0, 3)
        handoff = DecodeHandoff(
            request=r,
            prefill_engine="e0",
            first_token_id=res.first_token_id,
            kv_transfer_params=res.kv_transfer_params,
        )
        rest = [c async for c in b.decode(handoff)]
        assert [t for c in rest for t in (c.top_logprobs or [])] == tops[1:]
        plain = [c async for c in b.generate(req("rk", 5))]
        assert all(c.top_logprobs is None for c in plain)  # not asked for: none computed
        assert b.sampling_problem(r.sampling) == ""
    finally:
        await b.close()


async def test_expired_kv_raises_before_any_token() -> None:
    b = SimBackend(P, "e0", speedup=200.0)
    await b.start()
    try:
        gone = DecodeHandoff(
            request=req("g", 10),
            prefill_engine="p",
            first_token_id=1,
            kv_transfer_params={"sim_expires_s": b.clock.now_s() - 1},
        )
        with pytest.raises(KvUnavailable):
            await anext(b.decode(gone))
    finally:
        await b.close()


async def test_abort_ends_a_stream_and_frees_its_kv() -> None:
    b = SimBackend(P, "e0", speedup=50.0)
    await b.start()
    try:
        stream = b.generate(req("long", 5_000))
        first = await anext(stream)
        assert first.token_ids and not first.finished
        await b.abort("long")
        rest = [c async for c in stream]
        assert rest == [] or not rest[-1].finished
        # Freed at the engine's next step boundary (a decode step: milliseconds of wall time here).
        for _ in range(100):
            if b.stats().running == 0:
                break
            await asyncio.sleep(0.01)
        assert b.core.kv_reserved == 0 and b.stats().running == 0
    finally:
        await b.close()


async def test_wall_time_is_the_modelled_time_over_the_speedup() -> None:
    speedup = 100.0
    b = SimBackend(P, "e0", speedup=speedup)
    await b.start()
    try:
        t0 = time.monotonic()
        await b.prefill(req("w", 10, prompt_len=60_000))
        wall = time.monotonic() - t0
        modelled = pm.prefill_time_s(P, 60_000, 0)
        assert wall >= 0.9 * modelled / speedup
    finally:
        await b.close()

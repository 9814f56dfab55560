"""Coalesced decode steps in the simulated engine: the same tokens and the same virtual time as stepping one at a
time, blocks that respect their budget and every finish, and a backend that keeps pace at a high speed-up."""

from __future__ import annotations

import asyncio
import time

import pytest

from proto import GenerateRequest, SamplingParams
from services.engine_agent.backends.sim_backend import SimBackend
from services.engine_agent.backends.sim_scheduler import SimScheduler, SimSeq
from services.engine_agent.backends.sim_tokens import SimTokens
from tests.engine_agent_support import PROFILE, generate_seq, modelled_s

# Output lengths and prompts chosen so sequences finish at different steps, with and without a prefix hit.
LENGTHS = [(1, 500), (7, 2_000), (150, 300), (151, 8_000), (900, 1_000), (2_500, 4_000)]


def gen(rid: str, max_tokens: int, prompt_len: int) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        traj_id=f"t-{rid}",
        turn=0,
        prompt_token_ids=[],
        prompt_len=prompt_len,
        sampling=SamplingParams(max_tokens=max_tokens, logprobs=True),
        reply_to="r",
    )


def decode_seq(rid: str, context: int, end: int) -> SimSeq:
    return SimSeq(
        request_id=rid,
        traj_id=f"t-{rid}",
        mode="decode",
        context_tokens=context,
        pos=1,
        end=end,
        end_reason="length",
        tokens=SimTokens(rid),
        want_logprobs=False,
    )


def run(sched: SimScheduler, seqs: list[SimSeq], budget_s: float) -> tuple[float, int, dict[str, tuple]]:
    """Step `sched` until idle; returns (virtual end time, steps planned, per-sequence outcome)."""
    now, planned = 0.0, 0
    out: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    while (step := sched.plan(now, budget_s)) is not None:
        planned += 1
        if step.steps > 1:  # only pure decode coalesces, within the budget, up to the first finish
            assert not step.chunks and step.duration_s <= budget_s
            assert step.steps <= min(s.end - s.pos for s in step.batch)
        now += step.duration_s
        for seq in sched.apply(step, now):
            out[seq.request_id] += seq.take()[0]
    outcome = {s.request_id: (out[s.request_id], s.pos, s.finish_reason, s.done) for s in seqs}
    return now, planned, outcome


@pytest.mark.parametrize("budget_s", [0.05, 0.5, 3.0])
def test_coalesced_generation_matches_step_by_step(budget_s: float) -> None:
    results = []
    for budget in (0.0, budget_s):
        sched = SimScheduler(PROFILE, "mixed", 131_072)
        seqs = [generate_seq(gen(f"g{i}", n, prompt)) for i, (n, prompt) in enumerate(LENGTHS)]
        for seq in seqs:
            sched.add_prefill(seq)
        results.append(run(sched, seqs, budget))
        assert sched.kv_reserved == 0 and not sched.running
    (t_step, n_step, step_out), (t_block, n_block, block_out) = results
    assert block_out == step_out
    assert {rid: o[1] for rid, o in block_out.items()} == {f"g{i}": n for i, (n, _) in enumerate(LENGTHS)}
    assert t_block == pytest.approx(t_step, rel=1e-9, abs=0.0)
    assert n_block < n_step / 3  # it did coalesce (a 2,500-token run is ~10 ms a step)


def test_coalesced_decode_role_matches_step_by_step_with_a_late_arrival() -> None:
    """A handoff arriving mid-run joins at a block boundary; with it arriving at the same boundary in both runs
    (right after the first sequence finishes) the two runs still agree exactly."""
    results = []
    for budget in (0.0, 1.0):
        sched = SimScheduler(PROFILE, "decode", 131_072)
        seqs = [decode_seq("a", 3_001, 40), decode_seq("b", 12_001, 700), decode_seq("late", 501, 300)]
        for seq in seqs[:2]:
            sched.add_incoming(seq)
            sched.arrive(seq.request_id)
        sched.add_incoming(seqs[2])
        now, out = 0.0, {s.request_id: 0 for s in seqs}
        while (step := sched.plan(now, budget)) is not None:
            now += step.duration_s
            for seq in sched.apply(step, now):
                out[seq.request_id] += len(seq.take()[0])
                if seq.request_id == "a" and seq.done:
                    sched.arrive("late")
        results.append((now, out))
    (t_step, out_step), (t_block, out_block) = results
    assert out_step == out_block == {"a": 39, "b": 699, "late": 299}
    assert t_block == pytest.approx(t_step, rel=1e-9, abs=0.0)


def test_a_block_stops_at_the_first_finish_and_never_passes_the_budget() -> None:
    sched = SimScheduler(PROFILE, "decode", 131_072)
    for rid, end in (("short", 11), ("long", 5_000)):
        seq = decode_seq(rid, 2_001, end)
        sched.add_incoming(seq)
        sched.arrive(rid)
    step = sched.plan(0.0, 100.0)
    assert (
        step is not None and step.steps == 10
    )  # "short" has 10 tokens left: it ends on the block's last step
    finished = [s.request_id for s in sched.apply(step, step.duration_s) if s.done]
    assert finished == ["short"]
    one = sched.plan(0.0, 0.0)
    assert one is not None and one.steps == 1  # no budget: one step, even if it alone exceeds it
    block = sched.plan(0.0, 10 * one.duration_s)
    assert block is not None and 8 <= block.steps <= 10 and block.duration_s <= 10 * one.duration_s


async def test_backend_keeps_pace_with_the_model_at_speedup_200() -> None:
    speedup = 200.0
    requests = [gen(f"b{i}", 2_000, 1_000) for i in range(8)]
    modelled = modelled_s(PROFILE, requests)
    backend = SimBackend(PROFILE, "bench", speedup=speedup)
    await backend.start()

    async def consume(r: GenerateRequest) -> int:
        return sum([len(c.token_ids) async for c in backend.generate(r)])

    try:
        t0 = time.monotonic()
        counts = await asyncio.gather(*(consume(r) for r in requests))
        wall = time.monotonic() - t0
    finally:
        await backend.close()
    ratio = wall * speedup / modelled
    print(f"8 x 2000 tokens at speedup {speedup:g}: modelled {modelled:.2f} s virtual, ratio {ratio:.3f}")
    assert counts == [2_000] * 8
    assert 0.95 < ratio < 3.0  # never faster than modelled; generous above (a shared, loaded machine)

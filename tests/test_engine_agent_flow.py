"""Engine agents on the simulated backend against a real nats-server: the flow of a turn, colocated and
disaggregated, with its events, stats, bad input and a handoff whose KV is gone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

import proto
from proto import (
    DecodeHandoff,
    EngineStats,
    PolicyVersionUpdate,
    PrefillDone,
    RequestFailed,
    RequestFinished,
    Subjects,
    TokenProgress,
)
from tests.engine_agent_support import (
    Watcher,
    expected_ids,
    make_agent,
    publish_work,
    request,
    wait_until,
    wait_work_queue_empty,
)

S = Subjects()


async def test_mixed_engine_streams_every_token_and_publishes_events(nats_server, nc) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    stats: list[EngineStats] = []
    await nc.subscribe(S.engine_stats("mix-0"), cb=collect(stats, EngineStats))
    agent = make_agent(nats_server.url, "mix-0", "mixed", speedup=5.0)
    await agent.start()
    try:
        rids = [f"m{i}" for i in range(3)]
        for rid in rids:
            await publish_work(nc, S.prefill_work_any, request(rid, max_tokens=300, prompt_len=3000))
        await watcher.wait_finished(rids)
        for rid in rids:
            chunks = watcher.assert_exact_stream(rid, 300)
            assert len(chunks) > 3  # streamed as it decodes, not in one piece
            final = chunks[-1]
            assert final.finish_reason == "length" and final.engine_id == "mix-0"
            assert final.prefill_engine == "mix-0" and final.prompt_tokens == 3000
            assert 0 < final.ttft_s <= final.e2e_s
        await wait_until(lambda: len(watcher.of(RequestFinished)) == 3)
        prefills = watcher.of(PrefillDone)
        assert sorted(p.request_id for p in prefills) == rids
        assert all(p.new_tokens == 3000 and not p.handed_off for p in prefills)
        assert {f.output_tokens for f in watcher.of(RequestFinished)} == {300}
        progress = watcher.of(TokenProgress)
        assert 0 < len(progress) < 900 / 10  # batched: far fewer messages than tokens
        assert max(len(p.items) for p in progress) == 3  # one message lists every running request
        seqs = [e.seq for e in watcher.events if isinstance(e, proto.EngineEvent)]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        await wait_until(lambda: any(s.decode_tokens_per_s > 0 for s in stats))
        assert all(s.role == "mixed" and s.backend == "sim" and s.kv_capacity_tokens > 0 for s in stats)
    finally:
        await agent.stop()


async def test_disaggregated_client_gets_exactly_max_tokens_once(nats_server, nc) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    prefill = make_agent(nats_server.url, "pre-0", "prefill")
    decode = make_agent(nats_server.url, "dec-0", "decode")
    await prefill.start()
    await decode.start()
    try:
        rids = [f"d{i}" for i in range(4)]
        # d1's previous turn was prefilled here, d2's on another engine: only d2 was sent away from its cache.
        homes = {"d1": "pre-0", "d2": "pre-9"}
        for rid in rids:
            work = request(rid, max_tokens=120, affinity_engine=homes.get(rid, ""))
            await publish_work(nc, S.prefill_work_any, work)
        await watcher.wait_finished(rids)
        for rid in rids:
            chunks = watcher.assert_exact_stream(rid, 120)
            assert {c.engine_id for c in chunks} == {"dec-0"}
            assert chunks[-1].prefill_engine == "pre-0"
        await wait_until(lambda: len(watcher.of(RequestFinished)) == 4)
        assert all(p.handed_off and p.engine_id == "pre-0" for p in watcher.of(PrefillDone))
        assert sorted(p.request_id for p in watcher.of(PrefillDone) if p.away) == ["d2"]
        assert {f.engine_id for f in watcher.of(RequestFinished)} == {"dec-0"}
        # Every piece of work was acked: nothing is left in the work queue.
        await wait_work_queue_empty(nc)
    finally:
        await prefill.stop()
        await decode.stop()


async def test_an_idle_mixed_engine_decodes_handoffs(nats_server, nc) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    prefill = make_agent(nats_server.url, "hp-0", "prefill")
    mixed = make_agent(nats_server.url, "hm-0", "mixed")
    await prefill.start()
    await mixed.start()
    try:
        rids = [f"h{i}" for i in range(2)]
        for rid in rids:  # addressed to the prefill engine, so they reach the mixed one only as handoffs
            await publish_work(nc, S.prefill_work_for("hp-0"), request(rid, max_tokens=30))
        await watcher.wait_finished(rids)
        for rid in rids:
            chunks = watcher.assert_exact_stream(rid, 30)
            assert {c.engine_id for c in chunks} == {"hm-0"} and chunks[-1].prefill_engine == "hp-0"
    finally:
        await prefill.stop()
        await mixed.stop()


async def test_affinity_work_goes_to_its_engine_and_hits_the_prefix_cache(nats_server, nc) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    agents = [make_agent(nats_server.url, f"aff-{i}", "mixed") for i in range(2)]
    for a in agents:
        await a.start()
    try:
        first = request("a0", max_tokens=20, prompt_len=5000)
        await publish_work(nc, S.prefill_work_for("aff-1"), first)
        await watcher.wait_finished(["a0"])
        assert watcher.chunks["a0"][-1].engine_id == "aff-1"
        # The next turn of the same trajectory, sent to the engine holding its prefix, computes only the new part.
        second = msgspec.structs.replace(
            request("a1", max_tokens=20, prompt_len=5300), traj_id="traj-a0", sim_cacheable_tokens=5020
        )
        await publish_work(nc, S.prefill_work_for("aff-1"), second)
        await watcher.wait_finished(["a1"])
        done = {p.request_id: p for p in watcher.of(PrefillDone)}
        assert (done["a1"].cached_tokens, done["a1"].new_tokens) == (5020, 280)
        assert watcher.chunks["a1"][-1].cached_tokens == 5020
    finally:
        for a in agents:
            await a.stop()


async def test_bad_request_fails_cleanly_and_the_engine_keeps_serving(nats_server, nc) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    errors: list[proto.ErrorReply] = []
    await nc.subscribe(S.errors, cb=collect(errors, proto.ErrorReply))
    agent = make_agent(nats_server.url, "bad-0", "mixed", max_model_len=4096)
    await agent.start()
    try:
        await publish_work(nc, S.prefill_work_any, request("too-long", max_tokens=10, prompt_len=5000))
        await nc.jetstream().publish(S.prefill_work_any, b"{not json")
        await publish_work(nc, S.prefill_work_any, request("fine", max_tokens=10, prompt_len=100))
        await watcher.wait_finished(["too-long", "fine"])
        (final,) = watcher.chunks["too-long"]
        assert final.finished and final.finish_reason == "error" and "max_model_len 4096" in final.error
        watcher.assert_exact_stream("fine", 10)
        await wait_until(lambda: len(watcher.of(RequestFailed)) == 1 and len(errors) >= 2)
        assert watcher.of(RequestFailed)[0].request_id == "too-long"
        assert {e.kind for e in errors} == {"invalid_request", "decode"}
        # Terminated, not redelivered: the queue is empty.
        await wait_until(lambda: agent.metrics.error_counts.get("invalid_request") == 1)
        await wait_work_queue_empty(nc)
    finally:
        await agent.stop()


async def test_handoff_whose_kv_is_gone_is_prefilled_again(nats_server, nc) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    prefill = make_agent(nats_server.url, "pre-k", "prefill")
    decode = make_agent(nats_server.url, "dec-k", "decode")
    await prefill.start()
    await decode.start()
    try:
        req = request("k0", max_tokens=50)
        stale = DecodeHandoff(
            request=req,
            prefill_engine="pre-gone",
            first_token_id=expected_ids("k0", 1)[0],
            first_logprob=-0.5,
            kv_transfer_params={"sim_engine": "pre-gone", "sim_expires_s": time.time() - 60},
            kv_tokens=req.prompt_len,
        )
        await publish_work(nc, S.decode_work_any, stale)
        await watcher.wait_finished(["k0"])
        chunks = watcher.assert_exact_stream("k0", 50)
        assert chunks[0].token_ids == expected_ids("k0", 1)  # the handed-off first token, streamed once
        assert decode.runner.kv_lost == 1
        assert [p.engine_id for p in watcher.of(PrefillDone)] == ["pre-k"]  # re-prefilled there
    finally:
        await prefill.stop()
        await decode.stop()


async def test_policy_version_is_picked_up_between_requests(nats_server, nc) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    agent = make_agent(nats_server.url, "pol-0", "mixed")
    await agent.start()
    try:
        await nc.publish(S.policy_version, proto.encode(PolicyVersionUpdate(version=7, ts_s=time.time())))
        await nc.publish(S.policy_version, proto.encode(PolicyVersionUpdate(version=3, ts_s=time.time())))
        await wait_until(lambda: agent.policy_version == 7)
        await publish_work(nc, S.prefill_work_any, request("p0", max_tokens=10))
        await watcher.wait_finished(["p0"])
        assert watcher.chunks["p0"][-1].policy_version == 7
        stats = agent.stats_snapshot()
        assert stats.policy_version == 7
        assert stats.prefix_cache_tokens > 0  # the finished turn's context stays cached for the next turn
    finally:
        await agent.stop()


def collect(out: list, cls: type) -> Callable[[Any], Awaitable[None]]:
    async def cb(msg: Any) -> None:
        out.append(proto.decode_as(msg.data, cls, msg.subject))

    return cb


async def test_work_on_any_queue_starts_without_waiting_out_another_queues_poll(nats_server, nc) -> None:
    """Every queue long-polls at once: a request addressed to the prefill engine, and then its handoff on the
    shared decode queue, are taken as they land, not after the 2 s poll of whichever queue was being watched."""
    watcher = Watcher()
    await watcher.attach(nc)
    prefill = make_agent(nats_server.url, "lp-p", "prefill", speedup=1000.0, any_poll_s=2.0)
    decode = make_agent(nats_server.url, "lp-d", "decode", speedup=1000.0, any_poll_s=2.0)
    await prefill.start()
    await decode.start()
    try:
        for i in range(3):
            await asyncio.sleep(0.3)  # every loop is inside its long poll again
            rid = f"lp{i}"
            t0 = time.monotonic()
            await publish_work(nc, S.prefill_work_for("lp-p"), request(rid, max_tokens=5))
            await watcher.wait_finished([rid])
            assert time.monotonic() - t0 < 1.0, "work waited out a poll of another queue"
            assert watcher.chunks[rid][-1].prefill_engine == "lp-p"
    finally:
        await prefill.stop()
        await decode.stop()


async def test_the_last_chunk_does_not_wait_out_the_chunk_interval(nats_server, nc) -> None:
    """Chunks are paced one per interval per request, but a request that ends mid-interval is answered at once
    (at a speed-up, a wall-clock pause becomes that many times more virtual seconds of turn latency)."""
    watcher = Watcher()
    await watcher.attach(nc)
    agent = make_agent(nats_server.url, "ci-0", "mixed", speedup=1000.0, chunk_interval_s=2.0)
    await agent.start()
    try:
        t0 = time.monotonic()
        await publish_work(nc, S.prefill_work_any, request("ci0", max_tokens=50))
        await watcher.wait_finished(["ci0"])
        assert time.monotonic() - t0 < 1.0, "the final chunk waited for the chunk interval"
        watcher.assert_exact_stream("ci0", 50)
    finally:
        await agent.stop()


async def test_stats_count_the_prompts_addressed_to_an_engine_that_it_has_not_pulled(nats_server, nc) -> None:
    """The affinity rule reads `waiting + addressed_waiting`: prompts addressed to a busy engine wait in its own
    queue on the bus, unseen by `waiting` (what it pulled), so the agent reports that backlog too."""
    from prorsa.client.directory import EngineDirectory

    seen: list[EngineStats] = []

    async def on_stats(msg: Any) -> None:
        seen.append(proto.decode(msg.data, EngineStats))

    await nc.subscribe(S.engine_stats("backlog-0"), cb=on_stats)
    agent = make_agent(nats_server.url, "backlog-0", "mixed")
    await agent.start()
    try:
        agent.puller.pause("test")  # it pulls nothing: what is addressed to it stays on the bus
        await agent.puller.wait_idle()
        for i in range(12):
            await publish_work(nc, S.prefill_work_for("backlog-0"), request(f"b{i}", max_tokens=4))
        await wait_until(lambda: bool(seen) and seen[-1].addressed_waiting == 12, 10.0)
        assert not EngineDirectory().accepts(seen[-1])  # 12 queued for it: a turn goes to the shared queue
        agent.puller.resume("test")
        await wait_until(lambda: seen[-1].addressed_waiting == 0, 20.0)
        assert EngineDirectory().accepts(seen[-1])
    finally:
        await agent.stop()

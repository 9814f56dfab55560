"""Abort on the bus (`AbortRequest` on `ns.abort`): the turn stops on whichever engine holds it — colocated, on the
decode engine of a disaggregated pair, or before any engine pulled it — its KV is freed, the partial output comes
back with finish_reason "abort" through the SDK (`Trajectory.abort`), and the work is acked, never redelivered."""

from __future__ import annotations

import asyncio

import proto
from prorsa.client.client import RolloutClient
from proto import AbortRequest, RequestFinished, SamplingParams, Subjects
from tests.engine_agent_support import Watcher, expected_ids, make_agent, wait_until, wait_work_queue_empty

S = Subjects()


async def _abort_mid_turn(url: str, nc: object, traj_id: str, engines: list) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    client = await RolloutClient.connect(url)
    try:
        traj = await client.start_trajectory(traj_id)
        streamed: list[int] = []
        turn = asyncio.create_task(
            traj.generate(list(range(1, 200)), SamplingParams(max_tokens=50_000), on_tokens=streamed.extend)
        )
        await wait_until(lambda: len(streamed) >= 20, timeout_s=20)
        await traj.abort("test")
        result = await asyncio.wait_for(turn, 10)
        assert result.finish_reason == "abort"
        assert 20 <= len(result.token_ids) < 50_000
        assert result.token_ids == expected_ids(
            f"{traj_id}:0", len(result.token_ids)
        )  # exactly what was sampled
        assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
        await wait_until(lambda: any(e.request_id == f"{traj_id}:0" for e in watcher.of(RequestFinished)))
        (done,) = [e for e in watcher.of(RequestFinished) if e.request_id == f"{traj_id}:0"]
        assert done.finish_reason == "abort" and done.output_tokens == len(result.token_ids)
        await wait_work_queue_empty(nc)  # acked: never redelivered
        await wait_until(lambda: all(e.backend.stats().kv_used_tokens == 0 for e in engines))  # KV freed
        assert traj.turn == 1  # the next turn goes on from the partial output
    finally:
        await client.close()


async def test_abort_stops_a_colocated_turn(nats_server, nc) -> None:
    agent = make_agent(nats_server.url, "mix-0", "mixed", speedup=1.0)
    await agent.start()
    try:
        await _abort_mid_turn(nats_server.url, nc, "ab-mixed", [agent])
        assert agent.runner.aborts == 1
    finally:
        await agent.stop()


async def test_abort_stops_a_turn_on_its_decode_engine(nats_server, nc) -> None:
    prefill = make_agent(nats_server.url, "pre-0", "prefill", speedup=1.0)
    decode = make_agent(nats_server.url, "dec-0", "decode", speedup=1.0)
    await prefill.start()
    await decode.start()
    try:
        await _abort_mid_turn(nats_server.url, nc, "ab-disagg", [prefill, decode])
        assert decode.runner.aborts == 1
    finally:
        await prefill.stop()
        await decode.stop()


async def test_a_turn_aborted_before_any_engine_pulled_it_is_answered_without_running(
    nats_server, nc
) -> None:
    client = await RolloutClient.connect(nats_server.url)
    agent = make_agent(nats_server.url, "mix-1", "mixed", speedup=1.0)
    try:
        await agent.start()
        await agent.puller.close()  # not pulling yet: the turn waits in the queue
        abort = AbortRequest(request_id="ab-early:0", traj_id="ab-early")
        await nc.publish(S.abort, proto.encode(abort))
        await wait_until(lambda: "ab-early:0" in agent.runner.aborted_ids)
    finally:
        await agent.stop()
    agent = make_agent(nats_server.url, "mix-1", "mixed", speedup=1.0)
    await agent.start()
    try:
        await nc.publish(
            S.abort, proto.encode(abort)
        )  # this engine instance saw none: as a broadcast would reach it
        await wait_until(lambda: "ab-early:0" in agent.runner.aborted_ids)
        traj = await client.start_trajectory("ab-early")
        result = await asyncio.wait_for(
            traj.generate(list(range(1, 200)), SamplingParams(max_tokens=50_000)), 10
        )
        assert result.finish_reason == "abort" and result.token_ids == []
        await wait_work_queue_empty(nc)
    finally:
        await agent.stop()
        await client.close()

"""The lean wire against a real nats-server and simulated engines: a 256k-token context through every path (client,
work queue, prefill engine, decode handoff, decode engine, tracker and events) under nats-server's default 1 MiB
max_payload; a turn whose engine is gone rebuilt from the context log elsewhere; a reference no log can resolve
failed with its reason; a request past max_payload refused before anything is published."""

from __future__ import annotations

import asyncio
import random
import signal
from functools import partial

import msgspec
import nats
import pytest

import proto
from prorsa.client import RolloutClient
from prorsa.client.client import PayloadTooLarge
from proto import (
    GenerateRequest,
    LifecycleSnapshot,
    RequestFailed,
    RequestFinished,
    SamplingParams,
    Subjects,
    TurnSubmitted,
)
from proto.context_log import ids_array, rebuild
from services.runtime import context_log_io
from services.runtime.bus import DEFAULT_MAX_PAYLOAD, ensure_streams
from services.runtime.context_log_io import read_segments
from services.runtime.nats_server import EmbeddedNatsServer
from services.trajectory_tracker.service import TrackerService
from tests.engine_agent_support import Watcher, make_agent, publish_work, request, wait_until
from tests.test_engine_agent_crash import ACK_WAIT_S, spawn_engine

S = Subjects()
MODEL_LEN = 262_144


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(151_000) for _ in range(n)]


@pytest.mark.timeout(120)
async def test_a_256k_token_context_runs_disaggregated_under_the_default_payload_limit(
    nats_server, nc
) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    lifecycle: list[proto.Message] = []
    await nc.subscribe(S.lifecycle, cb=partial(_append, lifecycle))
    snapshots: list[LifecycleSnapshot] = []
    await nc.subscribe(S.snapshot, cb=partial(_append, snapshots))
    prefill = make_agent(nats_server.url, "pre-0", "prefill", speedup=200.0, max_model_len=MODEL_LEN)
    decode = make_agent(nats_server.url, "dec-0", "decode", speedup=200.0, max_model_len=MODEL_LEN)
    tracker = TrackerService(nats_server.url, snapshot_interval_s=0.1)
    for svc in (prefill, decode, tracker):
        await svc.start()
    client = await RolloutClient.connect(nats_server.url)
    try:
        assert client.nc.max_payload == DEFAULT_MAX_PAYLOAD  # nats-server's default: 1 MiB
        traj = await client.start_trajectory("long-0", task="coding")
        sampling = SamplingParams(max_tokens=8)
        # Turn 0: 240k tokens, too many to inline; turn 1 adds 2k (inline); turn 2 adds 20k (not inline).
        prompt = tokens(240_000, 0)
        for turn, observation in enumerate((0, 2_000, 20_000)):
            if turn:
                prompt = prompt + list(traj.results[-1].token_ids) + tokens(observation, turn)
            result = await traj.generate(prompt, sampling, timeout_s=60)
            assert (
                len(result.token_ids) == 8
                and result.engine_id == "dec-0"
                and result.prefill_engine == "pre-0"
            )
            for agent in (prefill, decode):  # both engines ran exactly the client's prompt
                held = agent.contexts.cache.get("long-0", turn, len(prompt))
                assert held is not None and held.tolist() == prompt, agent.engine_id
        assert len(prompt) == 262_016
        # The prefill engine read the log for turn 0 and for turn 2's ids, and extended turn 0 in memory for turn
        # 1; the decode engine likewise (it held turn 0 from its first handoff).
        assert prefill.contexts.log_reads == 2 and decode.contexts.log_reads == 2
        # Each work message stayed small; the ids crossed once, as 4-byte ids, into the log.
        assert client.request_bytes < 32 * 1024
        assert client.context_bytes == 4 * len(prompt)
        await wait_until(lambda: len(watcher.of(RequestFinished)) == 3, timeout_s=10)
        assert [f.prompt_tokens for f in watcher.of(RequestFinished)] == [240_000, 242_008, 262_016]
        submitted = [e.prompt_tokens for e in lifecycle if isinstance(e, TurnSubmitted)]
        assert submitted == [240_000, 242_008, 262_016]
        await wait_until(lambda: any(_context_of(s, "long-0") >= 262_016 for s in snapshots), timeout_s=10)
        await traj.finish()
        assert (await read_segments(client.nc, S, "long-0")).segments == {}  # purged with the trajectory
    finally:
        await client.close()
        for svc in (prefill, decode, tracker):
            await svc.stop()


@pytest.mark.timeout(60)
async def test_a_turn_whose_engine_is_gone_is_rebuilt_from_the_log_on_another(nats_server) -> None:
    first = make_agent(nats_server.url, "mix-a", "mixed", speedup=50.0)
    await first.start()
    client = await RolloutClient.connect(nats_server.url)
    second = None
    try:
        traj = await client.start_trajectory("moved-0")
        prompt = tokens(3_000, 1)
        out = await traj.generate(prompt, SamplingParams(max_tokens=4), timeout_s=30)
        assert out.engine_id == "mix-a"
        await first.stop()  # the engine holding the prefix is gone
        second = make_agent(nats_server.url, "mix-b", "mixed", speedup=50.0)
        await second.start()
        prompt = prompt + list(out.token_ids) + tokens(100, 2)
        out = await traj.generate(prompt, SamplingParams(max_tokens=4), timeout_s=30)
        assert out.engine_id == "mix-b"
        assert second.contexts.log_reads == 1  # it never saw turn 0: read from the log
        held = second.contexts.cache.get("moved-0", 1, len(prompt))
        assert held is not None and held.tolist() == prompt
        await traj.finish()
    finally:
        await client.close()
        if second is not None:
            await second.stop()


@pytest.mark.timeout(60)
async def test_a_lean_turn_migrated_mid_stream_finishes_on_an_engine_that_never_held_it(nats_server) -> None:
    first = make_agent(nats_server.url, "mix-a", "mixed", speedup=2.0)  # slow: the stream is still running
    await first.start()
    client = await RolloutClient.connect(nats_server.url)
    second = None
    try:
        traj = await client.start_trajectory("migr-0")
        prompt = tokens(2_000, 4)
        out = await traj.generate(prompt, SamplingParams(max_tokens=2), timeout_s=30)
        prompt = prompt + list(out.token_ids) + tokens(300, 5)
        streamed: list[int] = []
        turn = asyncio.create_task(
            traj.generate(prompt, SamplingParams(max_tokens=300, ignore_eos=True), on_tokens=streamed.extend)
        )
        await wait_until(lambda: len(streamed) >= 5, timeout_s=20)
        await first.stop()  # hands the running decode on: a GenerateRequest resuming after what was streamed
        second = make_agent(nats_server.url, "mix-b", "mixed", speedup=200.0)
        await second.start()
        result = await asyncio.wait_for(turn, 30)
        assert len(result.token_ids) == 300 and result.engine_id == "mix-b"
        assert second.contexts.log_reads == 1  # the lean request's prefix came from the log
        held = second.contexts.cache.get("migr-0", 1, len(prompt))
        assert held is not None and held.tolist() == prompt
        await traj.finish()
    finally:
        await client.close()
        if second is not None:
            await second.stop()


@pytest.mark.timeout(90)
async def test_a_lean_turn_of_a_killed_engine_is_redelivered_and_rebuilt_on_another(nats_server, nc) -> None:
    seen: list[proto.Message] = []
    await nc.subscribe(S.engine_stats("crash-a"), cb=partial(_append, seen))
    proc = spawn_engine(nats_server.url, "crash-a")  # SIGKILL: no ack, no hand-off
    client = await RolloutClient.connect(nats_server.url)
    survivor = make_agent(nats_server.url, "crash-b", "mixed", speedup=50.0, ack_wait_s=ACK_WAIT_S)
    try:
        await wait_until(lambda: bool(seen), timeout_s=20)
        traj = await client.start_trajectory("crash-0")
        prompt = tokens(2_000, 9)
        out = await traj.generate(prompt, SamplingParams(max_tokens=2), timeout_s=30)
        assert out.engine_id == "crash-a"
        # The survivor watches crash-a from now on, so it moves crash-a's addressed turn once crash-a is silent
        # (rescue.py), as any live peer would; the turn goes to crash-a, which holds its prefix.
        await survivor.start()
        await wait_until(lambda: "crash-a" in survivor.rescue.watch.last_seen, timeout_s=10)
        prompt = prompt + list(out.token_ids) + tokens(200, 10)
        streamed: list[int] = []
        turn = asyncio.create_task(
            traj.generate(prompt, SamplingParams(max_tokens=400, ignore_eos=True), on_tokens=streamed.extend)
        )
        await wait_until(lambda: len(streamed) >= 10, timeout_s=20)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=5)
        result = await asyncio.wait_for(turn, 40)  # redelivered after ack_wait, restarted from chunk 0
        assert len(result.token_ids) == 400 and result.engine_id == "crash-b" and result.restarts == 1
        assert survivor.contexts.log_reads == 1
        held = survivor.contexts.cache.get("crash-0", 1, len(prompt))
        assert held is not None and held.tolist() == prompt
        await traj.finish()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await client.close()
        await survivor.stop()


@pytest.mark.timeout(60)
async def test_a_reference_no_log_resolves_fails_with_its_reason_and_the_engine_serves_on(
    nats_server, nc
) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    agent = make_agent(nats_server.url, "mix-0", "mixed", speedup=50.0)
    await agent.start()
    try:
        lost = _lean(request("lost", max_tokens=4, prompt_len=60), turn=1, prefix_turn=0, prefix_len=50)
        await publish_work(nc, S.prefill_work_any, lost)
        await watcher.wait_finished(["lost"])
        final = watcher.chunks["lost"][-1]
        assert final.finish_reason == "error"
        assert "context log" in final.error and "turn 0 is not in the context log" in final.error
        await wait_until(lambda: len(watcher.of(RequestFailed)) == 1)
        assert watcher.of(RequestFailed)[0].request_id == "lost"
        await publish_work(nc, S.prefill_work_any, request("fine", max_tokens=4, prompt_len=100))
        await watcher.wait_finished(["fine"])
        assert watcher.chunks["fine"][-1].finish_reason == "length"
    finally:
        await agent.stop()


@pytest.mark.timeout(60)
async def test_junk_in_a_trajectorys_log_fails_its_turn_with_the_reason(nats_server, nc) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    agent = make_agent(nats_server.url, "mix-0", "mixed", speedup=50.0)
    await agent.start()
    try:
        await nc.jetstream().publish(S.context("junk-0", 0), b"not a segment")  # no part headers
        req = _lean(request("junk", max_tokens=4, prompt_len=60), turn=1, prefix_turn=0, prefix_len=50)
        await publish_work(nc, S.prefill_work_any, msgspec.structs.replace(req, traj_id="junk-0"))
        await watcher.wait_finished(["junk"])
        final = watcher.chunks["junk"][-1]
        assert final.finish_reason == "error" and "junk-0" in final.error and "Prorsa-Part" in final.error
        assert agent.contexts.log_read_errors == 1
    finally:
        await agent.stop()


@pytest.mark.timeout(60)
async def test_a_request_past_max_payload_is_refused_before_anything_is_published(nats_server, nc) -> None:
    lifecycle: list[proto.Message] = []
    await nc.subscribe(S.lifecycle, cb=partial(_append, lifecycle))
    client = await RolloutClient.connect(nats_server.url, lean_wire=False)  # the whole context inline
    try:
        traj = await client.start_trajectory("big-0")
        with pytest.raises(
            PayloadTooLarge, match=r"big-0:0: the request is \d+ bytes .* max_payload of 1048576"
        ):
            await traj.generate(tokens(200_000, 3), SamplingParams(max_tokens=4))
        await nc.flush()
        await asyncio.sleep(0.2)
        assert [type(e).__name__ for e in lifecycle] == [
            "TrajectoryStarted"
        ]  # no turn the cluster cannot run
        info = await nc.jetstream().stream_info(S.work_stream)
        assert info.state.messages == 0
    finally:
        await client.close()


@pytest.mark.parametrize("batched", [True, False], ids=["batched-direct-get", "one-get-per-message"])
async def test_the_log_reads_back_every_segment_either_way(nc, monkeypatch, batched: bool) -> None:
    monkeypatch.setattr(context_log_io, "BATCH", 3)  # several batches for one trajectory
    if not batched:  # as against a nats-server older than 2.11
        monkeypatch.setattr(context_log_io, "BATCH_GET_SINCE", (99, 0))
    js = nc.jetstream()
    prompts = {0: tokens(1_000, 6)}
    prompts[1] = prompts[0] + tokens(10, 7)
    prompts[2] = tokens(700, 8)  # a rewritten history: logged whole
    written = 0
    for turn, (prefix_turn, prefix_len) in enumerate([(0, 0), (0, 1_000), (0, 0)]):
        ids = ids_array(prompts[turn][prefix_len:])
        written += await context_log_io.write_segment(
            js, S, "log-0", turn, prefix_turn, prefix_len, ids, max_payload=2_048, writer="w", wait_s=5
        )  # 256 ids a part: turn 0 is four messages
    await context_log_io.write_segment(
        js, S, "log-1", 0, 0, 0, ids_array([1]), 2_048, "w", 5
    )  # another trajectory
    read = await context_log_io.read_segments(nc, S, "log-0")
    assert written == 4 * (1_000 + 10 + 700) and sorted(read.segments) == [0, 1, 2]
    for turn, prompt in prompts.items():
        assert rebuild("log-0", turn, read.segments).tolist() == prompt
    # From a position on: only what came after (turn 2's three parts, after turn 1's message at sequence 5).
    assert read.last_seq == 8
    assert sorted((await context_log_io.read_segments(nc, S, "log-0", after_seq=5)).segments) == [2]
    await context_log_io.purge(js, S, "log-0")
    assert (await context_log_io.read_segments(nc, S, "log-0")).segments == {}
    assert list((await context_log_io.read_segments(nc, S, "log-1")).segments) == [0]


@pytest.mark.timeout(60)
async def test_a_handoff_over_max_payload_fails_its_turn_at_once_with_the_reason() -> None:
    # A whole-context request just under a 64 KiB max_payload: its decode handoff (the request plus the KV's
    # whereabouts) is not, so the prefill engine could never publish it.
    with EmbeddedNatsServer(max_payload=65_536) as server:
        conn = await nats.connect(server.url)
        await ensure_streams(conn.jetstream(), S)
        watcher = Watcher()
        await watcher.attach(conn)
        prefill = make_agent(server.url, "pre-0", "prefill", speedup=50.0)
        await prefill.start()
        try:
            n = 9_000
            while len(proto.encode(_whole("big", n))) < 65_536 - 200:
                n += 10
            assert len(proto.encode(_whole("big", n))) <= 65_536
            await publish_work(conn, S.prefill_work_any, _whole("big", n))
            await watcher.wait_finished(["big"])
            final = watcher.chunks["big"][-1]
            assert (
                final.finish_reason == "error" and "exceeds the server's max_payload of 65536" in final.error
            )
            await wait_until(lambda: len(watcher.of(RequestFailed)) == 1)
            assert prefill.runner.prefill_new_tokens == n  # prefilled once: no redelivery, no retry
        finally:
            await prefill.stop()
            await conn.close()


def _whole(rid: str, n: int) -> GenerateRequest:
    return msgspec.structs.replace(
        request(rid, max_tokens=4, prompt_len=n), prompt_token_ids=[100_000 + i for i in range(n)]
    )


def _lean(req: GenerateRequest, turn: int, prefix_turn: int, prefix_len: int) -> GenerateRequest:
    ids = list(range(req.prompt_len - prefix_len))
    return msgspec.structs.replace(
        req,
        turn=turn,
        prompt_token_ids=ids,
        prefix_turn=prefix_turn,
        prefix_len=prefix_len,
        context_logged=True,
    )


def _context_of(snapshot: LifecycleSnapshot, traj_id: str) -> int:
    return max((t.context_tokens for t in snapshot.trajectories if t.traj_id == traj_id), default=0)


async def _append(into: list, msg) -> None:  # noqa: ANN001 - a nats Msg
    into.append(proto.decode(msg.data, msg.subject))

"""Issue 14, findings 5-7, through the client SDK against a real nats-server and engine agent:
- results survive a nats-server restart (chunks missed while disconnected are read back from the REPLIES stream),
  and the tracker's timeouts are wall seconds; a publish made while the server stops on SIGTERM (JetStream gone,
  the connection still up: "no responders") waits for the stream instead of failing the trajectory;
- a second run that reuses trajectory ids is not dropped by JetStream's duplicate window;
- a bounded work queue refuses a saturated cluster's turns, and the client backs off without dropping any."""

from __future__ import annotations

import asyncio
import signal
import time

import nats
import pytest

from prorsa.client import RolloutClient
from prorsa.client.client import ClusterSaturated
from prorsa.client.recovery import ReconnectWatch
from prorsa.client.workload_hint import WorkloadHint, generate_hinted
from proto import GenerateRequest, SamplingParams, Subjects, TrajectoryStarted
from services.engine_agent.backends.sim_tokens import SimTokens
from services.runtime import clock
from services.runtime.bus import ensure_streams
from services.runtime.nats_server import EmbeddedNatsServer
from services.trajectory_tracker.core import TrackerConfig
from services.trajectory_tracker.service import TrackerService
from tests.engine_agent_support import make_agent, wait_until

S = Subjects()


def expected(request_id: str, n: int) -> list[int]:
    tokens = SimTokens(request_id)
    return [tokens.at(i)[0] for i in range(n)]


async def one_turn(client: RolloutClient, traj_id: str, max_tokens: int) -> list[int]:
    traj = await client.start_trajectory(traj_id)
    res = await generate_hinted(traj, [], SamplingParams(max_tokens=max_tokens), WorkloadHint(500))
    await traj.finish()
    return res.token_ids


def test_reconnect_watch_replays_from_before_the_outage() -> None:
    w = ReconnectWatch()
    assert w.poll(True, 0, 100.0) is None
    assert w.poll(False, 0, 101.0) is None  # down: not "last seen up"
    assert w.poll(False, 0, 104.0) is None
    assert w.poll(True, 1, 105.0) == 100.0 - 5.0
    assert w.poll(True, 1, 106.0) is None


@pytest.mark.timeout(90)
async def test_results_survive_a_server_restart(tmp_path) -> None:  # noqa: ANN001
    srv = EmbeddedNatsServer(store_dir=str(tmp_path / "js")).start()
    agent = make_agent(srv.url, "restart-0", "mixed", speedup=2.0)
    client = None
    try:
        await agent.start()
        # The client reconnects well after the engine: what the engine flushes on reconnecting (the chunks it
        # streamed during the outage) reaches the new server while nobody is subscribed to it yet.
        client = RolloutClient(
            await nats.connect(srv.url, max_reconnect_attempts=-1, reconnect_time_wait=1.5)
        )
        await client.start()
        n_tokens = 300
        turns = [asyncio.create_task(one_turn(client, f"r{i}", n_tokens)) for i in range(4)]
        await wait_until(
            lambda: len(client._pending) == 4 and all(p.assembler.chunks for p in client._pending.values()),
            timeout_s=20,
        )
        srv.signal(signal.SIGKILL)  # mid-stream: every request has chunks, none is finished
        srv._proc.wait(timeout=5)  # type: ignore[union-attr]
        await asyncio.sleep(2.0)
        srv.start()
        t_back = time.monotonic()
        outputs = await asyncio.wait_for(asyncio.gather(*turns), timeout=30)
        recovered_s = time.monotonic() - t_back
        for i, ids in enumerate(outputs):
            assert ids == expected(f"r{i}:0", n_tokens)
        # Without the REPLIES stream the chunks streamed during the outage were lost and each turn waited out
        # retry_after_s (120 s): here they are read back and the turns finish within seconds of the server.
        assert recovered_s <= 5.0 + n_tokens / 2 / 100, f"{recovered_s:.1f} s after the server came back"
        assert client.replayed_chunks > 0
    finally:
        if client is not None:
            await client.close()
        await agent.stop()
        srv.stop(remove_store=True)


async def test_publishes_wait_out_a_server_without_jetstream(nats_server: EmbeddedNatsServer, nc) -> None:  # noqa: ANN001
    """A nats-server stopping on SIGTERM shuts JetStream down before it drops the connections: for a moment every
    stream publish gets a "no responders" reply (nats.py: NoStreamResponseError). The campaign's trajectory f11526
    died of that in `emit`/`submit`. Here the same reply comes from the real server with the streams deleted."""
    client = RolloutClient(nc, publish_wait_s=20.0)
    await client.start()
    js = nc.jetstream()
    try:
        for stream in (S.events_stream, S.work_stream):
            await js.delete_stream(stream)
        started = asyncio.create_task(client.start_trajectory("nj", task="t"))
        req = GenerateRequest(
            request_id="nj:0",
            traj_id="nj",
            turn=0,
            prompt_token_ids=[],
            prompt_len=10,
            sampling=SamplingParams(max_tokens=4),
            reply_to=client.reply_subject(0),
        )
        submitted = asyncio.create_task(client.submit(req))
        await asyncio.sleep(0.8)
        assert not started.done() and not submitted.done(), "a publish without JetStream must wait, not fail"
        await ensure_streams(js, S)  # JetStream is back
        traj = await asyncio.wait_for(started, timeout=10)
        assert traj.traj_id == "nj"
        await wait_until(lambda: bool(client._pending.get("nj:0")), timeout_s=5)

        async def stored(stream: str) -> int:
            return (await js.stream_info(stream)).state.messages

        deadline = time.monotonic() + 10
        while (await stored(S.events_stream)) < 1 or (await stored(S.work_stream)) < 1:
            assert time.monotonic() < deadline, "the publishes did not land once the streams were back"
            await asyncio.sleep(0.1)
        assert not submitted.done()  # still waiting for an engine: nothing failed
    finally:
        for task in (started, submitted):
            task.cancel()
        await asyncio.gather(started, submitted, return_exceptions=True)
        for task in client._tasks:
            task.cancel()


async def test_tracker_timeouts_are_wall_seconds(nats_server: EmbeddedNatsServer, nc) -> None:  # noqa: ANN001
    with clock.time_scale_set(1000.0):  # simulated engines at 1000×: 1 wall second = 1000 "workload" seconds
        svc = TrackerService(
            nats_server.url,
            snapshot_interval_s=100.0,
            config=TrackerConfig(silent_after_s=1.0, lost_after_s=3.0),
        )
        await svc.start()
        try:
            ev = TrajectoryStarted(traj_id="quiet", ts_s=svc.clock.now_s(), source="c", seq=1)
            from proto import encode

            await nc.jetstream().publish(S.lifecycle, encode(ev))
            await wait_until(lambda: svc.core.live_count == 1, timeout_s=5)
            await asyncio.sleep(1.5)
            await svc.publish_snapshot()
            assert svc.core.live_count == 1, "lost after 1.5 wall s although lost_after_s is 3 wall s"
        finally:
            await svc.stop()


async def test_a_second_run_with_the_same_trajectory_ids_is_not_dropped(
    nats_server: EmbeddedNatsServer,
) -> None:
    agent = make_agent(nats_server.url, "rerun-0", "mixed")
    await agent.start()
    try:
        for run in range(2):  # e.g. RolloutDriver names trajectories s0-0, s0-1, ... in every run
            client = await RolloutClient.connect(nats_server.url, retry_after_s=30.0)
            try:
                ids = await asyncio.wait_for(one_turn(client, "s0-0", 8), timeout=10)
                assert ids == expected("s0-0:0", 8), run
            finally:
                await client.close()
        # Within one client a request id in flight twice is refused with a clear error.
        client = await RolloutClient.connect(nats_server.url)
        try:
            traj = await client.start_trajectory("dup")
            first = asyncio.create_task(
                generate_hinted(traj, [], SamplingParams(max_tokens=50), WorkloadHint(100))
            )
            await wait_until(lambda: "dup:0" in client._pending)
            twin = await client.start_trajectory("dup")
            with pytest.raises(ValueError, match="already in flight"):
                await generate_hinted(twin, [], SamplingParams(max_tokens=5), WorkloadHint(100))
            await asyncio.wait_for(first, timeout=10)
        finally:
            await client.close()
    finally:
        await agent.stop()


async def test_a_full_queue_refuses_and_the_client_backs_off_without_dropping(
    nats_server: EmbeddedNatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRORSA_WORK_QUEUE_MAX", "4")
    client = await RolloutClient.connect(nats_server.url, admission_timeout_s=0.5)
    try:
        # No engine: the queue fills, then a turn is refused and the caller is told the cluster is saturated.
        parked = [asyncio.create_task(one_turn(client, f"p{i}", 5)) for i in range(4)]
        await wait_until(lambda: len(client._pending) == 4)
        await asyncio.sleep(0.2)
        with pytest.raises(ClusterSaturated, match="saturated"):
            await one_turn(client, "refused", 5)
        assert client.refused > 0
        # An engine comes: the parked turns and 20 more, all admitted in turn through the 4-deep queue.
        client.admission_timeout_s = None
        agent = make_agent(nats_server.url, "bp-0", "mixed", max_fetch=2, prefill_budget_tokens=1000)
        await agent.start()
        try:
            more = [asyncio.create_task(one_turn(client, f"m{i}", 5)) for i in range(20)]
            outs = await asyncio.wait_for(asyncio.gather(*parked, *more), timeout=60)
            assert len(outs) == 24 and all(len(o) == 5 for o in outs)
            assert client.refused > 1 and client.saturated_s > 0
        finally:
            await agent.stop()
    finally:
        await client.close()


def test_a_retry_is_assembled_on_its_own_never_spliced_into_the_first_attempt() -> None:
    from prorsa.client.stream import StreamAssembler
    from proto import TokenChunk

    def chunk(attempt: int, index: int, ids: list[int], final: bool = False) -> TokenChunk:
        return TokenChunk(
            request_id="r", index=index, token_ids=ids, finished=final, engine_id="e0", attempt=attempt
        )

    a = StreamAssembler("r")
    # Attempt 0 lost its chunk 1 in a server restart; the early retry streams from the same engine with other
    # chunk boundaries. Index 1 of attempt 1 must not fill attempt 0's hole.
    assert a.add(chunk(0, 0, [1, 2])) is None
    assert a.add(chunk(0, 2, [5], final=True)) is None
    assert a.add(chunk(1, 0, [1])) is None
    assert a.add(chunk(1, 1, [2, 3, 4])) is None
    res = a.add(chunk(1, 2, [5], final=True))
    assert res is not None and res.token_ids == [1, 2, 3, 4, 5]


def test_a_replacement_engine_with_the_same_id_restarts_the_stream() -> None:
    from prorsa.client.stream import StreamAssembler
    from proto import TokenChunk

    def chunk(stream: str, index: int, ids: list[int], final: bool = False) -> TokenChunk:
        return TokenChunk(
            request_id="r", index=index, token_ids=ids, finished=final, engine_id="engine-0", stream=stream
        )

    a = StreamAssembler("r")
    # engine-0 streamed two chunks and was killed; its replacement (same id) runs the redelivered request from
    # scratch with other chunk boundaries: its chunk 0 restarts the stream instead of being dropped as a duplicate.
    assert a.add(chunk("dead", 0, [1])) is None and a.add(chunk("dead", 1, [2, 3])) is None
    assert a.add(chunk("new", 0, [1, 2])) is None
    assert a.add(chunk("new", 1, [3, 4])) is None
    res = a.add(chunk("new", 2, [5], final=True))
    assert res is not None and res.token_ids == [1, 2, 3, 4, 5] and res.restarts == 1


def test_a_concurrent_duplicate_run_is_ignored_and_a_migration_followed() -> None:
    from prorsa.client.stream import StreamAssembler
    from proto import TokenChunk

    def chunk(stream: str, base: int, index: int, ids: list[int], final: bool = False) -> TokenChunk:
        return TokenChunk(
            request_id="r",
            index=index,
            token_ids=ids,
            finished=final,
            engine_id=stream,
            stream=stream,
            stream_base=base,
        )

    a = StreamAssembler("r")
    assert a.add(chunk("A", 0, 0, [1])) is None
    assert a.add(chunk("A", 0, 1, [2])) is None
    # A redelivery ran the request a second time on engine B, from scratch: B's chunk 0 restarts the stream;
    # from then on A's chunks (other boundaries) are ignored, never spliced in.
    assert a.add(chunk("B", 0, 0, [1, 2, 3])) is None
    assert a.add(chunk("A", 0, 2, [3])) is None
    # B is migrated (role switch): C continues from B's next index.
    assert a.add(chunk("C", 1, 1, [4])) is None
    assert a.add(chunk("A", 0, 3, [4, 5], final=True)) is None
    res = a.add(chunk("C", 1, 2, [5], final=True))
    assert res is not None and res.token_ids == [1, 2, 3, 4, 5]

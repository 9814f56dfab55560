"""The RL control plane on simulated engines over a real nats-server (issue 31): the weights barrier with an engine
killed and restarted mid-update, per-token versions across an in-flight update, the staleness bound, the handoff
rule across versions, pause/resume and abort by version — partial outputs with their versions, nothing lost."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

import proto
from prorsa.client.client import GenerateError, RolloutClient
from prorsa.client.weights import WeightUpdateError
from proto import DecodeHandoff, SamplingParams, Subjects, WeightsStatus
from services.engine_agent.agent import AgentConfig, EngineAgent
from services.engine_agent.backends.sim_backend import SimBackend
from tests.engine_agent_support import (
    PROFILE,
    Watcher,
    expected_ids,
    publish_work,
    request,
    wait_until,
    wait_work_queue_empty,
)

pytestmark = pytest.mark.timeout(120)
S = Subjects()
PROMPT = list(range(1, 200))


def agent(
    url: str, engine_id: str, role: str = "mixed", speedup: float = 20.0, update_s: float = 1.0
) -> EngineAgent:
    """A test engine whose weight loads take `update_s` modelled seconds (`update_s / speedup` wall)."""
    backend = SimBackend(PROFILE, engine_id, role=role, speedup=speedup, weight_update_s=update_s)
    config = AgentConfig(
        role=role,
        ack_wait_s=5.0,
        stats_interval_s=0.2,
        progress_interval_s=0.1,
        chunk_interval_s=0.01,
        any_poll_s=0.1,
    )
    return EngineAgent(url, engine_id=engine_id, backend=backend, config=config)


async def kill(a: EngineAgent) -> None:
    """As SIGKILL would: no hand-off, no ack, the connection just goes (held work is redelivered by JetStream)."""
    for task in list(a._tasks):
        task.cancel()
    for task in list(a._tasks):
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert a.nc is not None
    await a.nc.close()
    await a.backend.close()


async def live_engines(client: RolloutClient, n: int) -> None:
    await wait_until(lambda: len(client.control.view.live(time.monotonic())) == n, timeout_s=10)


async def test_barrier_with_four_engines_one_killed_mid_update_and_restarted(nats_server, nc) -> None:
    url = nats_server.url
    engines = [agent(url, f"eng-{i}") for i in range(4)]
    for e in engines:
        await e.start()
    client = await RolloutClient.connect(url)
    statuses: list[WeightsStatus] = []

    async def on_status(msg: Any) -> None:
        statuses.append(proto.decode_as(msg.data, WeightsStatus, msg.subject))

    await nc.subscribe(S.policy_status("eng-3"), cb=on_status)
    restarted: EngineAgent | None = None
    try:
        await live_engines(client, 4)
        update = asyncio.create_task(client.update_weights(1, timeout_s=30))
        await asyncio.sleep(0.02)
        await kill(engines[3])  # mid-update
        # Its replacement (same id) loads slowly: 60 modelled s at a speed-up of 20 = 3 s.
        restarted = agent(url, "eng-3", update_s=60.0)
        versions_at_first_fetch: list[int] = []
        fetch = restarted.puller._fetch

        async def recording_fetch(*args: Any, **kwargs: Any) -> int:
            versions_at_first_fetch.append(restarted.policy_version)
            return await fetch(*args, **kwargs)

        restarted.puller._fetch = recording_fetch  # type: ignore[method-assign]
        started_at = len(statuses)
        start = asyncio.create_task(restarted.start())
        await wait_until(lambda: any(s.state in ("starting", "loading") for s in statuses[started_at:]))
        # While the replacement loads, the barrier names it and only it ...
        with pytest.raises(WeightUpdateError) as err:
            await client.update_weights(1, timeout_s=0.5)
        assert err.value.engines == ["eng-3"] and err.value.timed_out
        assert not update.done()
        # ... and returns once it serves the current version.
        ack = await update
        assert ack.engines == {f"eng-{i}": 1 for i in range(4)}
        assert ack.barrier_s >= 3.0 * 0.9  # the replacement's load, 3 s
        await start
        # It loaded version 1 before it pulled any work, and never reported serving anything older.
        assert versions_at_first_fetch and set(versions_at_first_fetch) == {1}
        after = statuses[started_at:]
        assert after[0].state == "starting" and after[0].policy_version == 0
        assert all(s.policy_version == 1 for s in after if s.state == "serving")
        assert restarted.weights.state.served == 1 and restarted.weights.loads == 1
    finally:
        await client.close()
        for e in [*engines[:3], *([restarted] if restarted is not None else [])]:
            await e.stop()


async def test_a_turn_straddling_an_inflight_update_carries_two_versions(nats_server, nc) -> None:
    e = agent(nats_server.url, "mix-0", speedup=1.0, update_s=0.3)
    await e.start()
    client = await RolloutClient.connect(nats_server.url)
    try:
        traj = await client.start_trajectory("straddle")
        streamed: list[int] = []
        turn = asyncio.create_task(
            traj.generate(PROMPT, SamplingParams(max_tokens=300), on_tokens=streamed.extend)
        )
        await wait_until(lambda: len(streamed) >= 20, timeout_s=20)
        ack = await client.update_weights(1, mode="inflight", timeout_s=10)
        assert ack.engines == {"mix-0": 1}
        result = await asyncio.wait_for(turn, 30)
        assert result.token_ids == expected_ids("straddle:0", 300)  # nothing lost, nothing doubled
        versions = result.token_versions
        assert len(versions) == len(result.token_ids) and versions == sorted(versions)
        assert versions[0] == 0 and versions[-1] == 1 and 20 <= versions.count(0) < 300
        assert result.policy_version == 1
    finally:
        await client.close()
        await e.stop()


async def test_a_turn_is_never_served_below_its_min_policy_version(nats_server, nc) -> None:
    fast = agent(nats_server.url, "fast-0")
    slow = agent(nats_server.url, "slow-0", update_s=80.0)  # 4 s to load version 1
    await fast.start()
    await slow.start()
    client = await RolloutClient.connect(nats_server.url)
    try:
        await live_engines(client, 2)
        with pytest.raises(WeightUpdateError) as err:  # the slow one is still loading
            await client.update_weights(1, mode="inflight", timeout_s=1.0)
        assert err.value.engines == ["slow-0"]
        trajs = [await client.start_trajectory(f"fresh-{i}") for i in range(6)]
        results = await asyncio.gather(
            *(t.generate(PROMPT, SamplingParams(max_tokens=40), min_policy_version=1) for t in trajs)
        )
        for t, r in zip(trajs, results, strict=True):
            assert r.token_ids == expected_ids(f"{t.traj_id}:0", 40)
            assert set(r.token_versions) == {1}, (r.engine_id, r.token_versions)
        # A version nobody knows of is refused at once, with the reason.
        with pytest.raises(GenerateError, match="needs policy version >= 5"):
            traj = await client.start_trajectory("too-new")
            await traj.generate(PROMPT, SamplingParams(max_tokens=8), min_policy_version=5)
        await wait_work_queue_empty(nc)
    finally:
        await client.close()
        await fast.stop()
        await slow.stop()


async def test_a_handoff_is_continued_only_on_the_weights_that_prefilled_it(nats_server, nc) -> None:
    """The rule (proto/README.md, "Policy versions"): a decode engine on newer weights has the turn prefilled again
    (never reading the old KV), one on older weights gives it back until it serves them, one on the same continues."""
    pre = agent(nats_server.url, "pre-h", role="prefill")
    dec = agent(nats_server.url, "dec-h", role="decode")
    await pre.start()
    await dec.start()
    watcher = Watcher()
    await watcher.attach(nc)
    client = await RolloutClient.connect(nats_server.url)
    try:
        await client.update_weights(1, timeout_s=10)
        params = {"sim_engine": "gone", "sim_expires_s": time.time() * 1e3}

        def handoff(rid: str, version: int, first: int) -> DecodeHandoff:
            return DecodeHandoff(
                request=request(rid, 30),
                prefill_engine="pre-x",
                first_token_id=first,
                kv_transfer_params=params,
                policy_version=version,
            )

        await publish_work(nc, S.decode_work_any, handoff("h-old", 0, 7))  # first token 7: never streamed
        await publish_work(nc, S.decode_work_any, handoff("h-same", 1, expected_ids("h-same", 1)[0]))
        await publish_work(nc, S.decode_work_any, handoff("h-new", 2, expected_ids("h-new", 1)[0]))
        await watcher.wait_finished(["h-old", "h-same"])
        for rid in ("h-old", "h-same"):
            chunks = watcher.assert_exact_stream(rid, 30)  # h-old from position 0: its token 7 dropped
            assert {c.policy_version for c in chunks} == {1}
        assert dec.runner.version_recomputes == 1
        assert [
            e for e in watcher.of(proto.PrefillDone) if e.request_id == "h-old" and e.engine_id == "pre-h"
        ]
        # Prefilled under version 2, which nobody serves yet: given back, never decoded on version 1.
        await wait_until(lambda: dec.runner.version_waits >= 1)
        assert not watcher.chunks["h-new"]
        await client.update_weights(2, timeout_s=10)
        await watcher.wait_finished(["h-new"], timeout_s=20)
        assert {c.policy_version for c in watcher.assert_exact_stream("h-new", 30)} == {2}
        await wait_work_queue_empty(nc)
    finally:
        await client.close()
        await pre.stop()
        await dec.stop()


async def test_a_prefill_that_straddles_an_update_is_not_handed_off(nats_server, nc) -> None:
    pre = agent(nats_server.url, "pre-0", role="prefill", speedup=1.0, update_s=0.2)
    dec = agent(nats_server.url, "dec-1", role="decode", speedup=20.0)
    await pre.start()
    await dec.start()
    client = await RolloutClient.connect(nats_server.url)
    try:
        traj = await client.start_trajectory("long-prompt")
        long_prompt = list(range(1, 60_001))
        turn = asyncio.create_task(traj.generate(long_prompt, SamplingParams(max_tokens=16)))
        await wait_until(lambda: any(j.phase == "prefill" for j in pre.runner.jobs.values()), timeout_s=20)
        await client.update_weights(1, mode="inflight", timeout_s=20)
        result = await asyncio.wait_for(turn, 60)
        assert pre.runner.version_recomputes >= 1  # requeued, prefilled again under version 1
        assert set(result.token_versions) == {1} and len(result.token_ids) == 16
    finally:
        await client.close()
        await pre.stop()
        await dec.stop()


async def test_pause_freezes_running_turns_and_queued_work_waits_nothing_lost(nats_server, nc) -> None:
    e = agent(nats_server.url, "mix-p", speedup=1.0)
    await e.start()
    client = await RolloutClient.connect(nats_server.url)
    try:
        running = await client.start_trajectory("paused-running")
        streamed: list[int] = []
        first = asyncio.create_task(
            running.generate(PROMPT, SamplingParams(max_tokens=200), on_tokens=streamed.extend)
        )
        await wait_until(lambda: len(streamed) >= 10, timeout_s=20)
        assert await client.pause("test") == ["mix-p"]
        await asyncio.sleep(0.3)  # chunks in flight land
        frozen = len(streamed)
        queued = await client.start_trajectory("paused-queued")
        queued_tokens: list[int] = []
        second = asyncio.create_task(
            queued.generate(PROMPT, SamplingParams(max_tokens=50), on_tokens=queued_tokens.extend)
        )
        late = agent(nats_server.url, "mix-late", speedup=1.0)  # an engine that starts while paused ...
        await late.start()
        assert late.weights.state.paused and late.puller.paused  # ... starts paused
        await asyncio.sleep(1.0)
        assert len(streamed) == frozen and not queued_tokens and not first.done()
        assert not late.runner.jobs
        # Pause, update, resume (AReaL's pattern): a drain-mode update does not wait for the frozen turn.
        ack = await client.update_weights(1, timeout_s=10)
        assert ack.engines == {"mix-late": 1, "mix-p": 1} and not first.done()
        assert await client.resume("test") == ["mix-late", "mix-p"]
        a, b = await asyncio.wait_for(asyncio.gather(first, second), 30)
        assert a.token_versions[0] == 0 and a.token_versions[-1] == 1 and set(b.token_versions) == {1}
        assert a.token_ids == expected_ids("paused-running:0", 200)
        assert b.token_ids == expected_ids("paused-queued:0", 50)
        await wait_work_queue_empty(nc)
        await late.stop()
    finally:
        await client.close()
        await e.stop()


async def test_abort_older_than_returns_partial_outputs_with_versions(nats_server, nc) -> None:
    e = agent(nats_server.url, "mix-a", speedup=1.0, update_s=0.2)
    await e.start()
    client = await RolloutClient.connect(nats_server.url)
    try:
        old = [await client.start_trajectory(f"old-{i}") for i in range(2)]
        streamed: dict[str, list[int]] = {t.traj_id: [] for t in old}
        turns = [
            asyncio.create_task(
                t.generate(PROMPT, SamplingParams(max_tokens=5_000), on_tokens=streamed[t.traj_id].extend)
            )
            for t in old
        ]
        await wait_until(lambda: all(len(v) >= 10 for v in streamed.values()), timeout_s=20)
        await client.update_weights(1, mode="inflight", timeout_s=10)
        fresh = await client.start_trajectory("fresh")
        fresh_turn = asyncio.create_task(fresh.generate(PROMPT, SamplingParams(max_tokens=30)))
        await wait_until(lambda: "fresh:0" in e.runner.jobs or fresh_turn.done(), timeout_s=10)
        aborted = await client.abort_older_than(1, "new weights")
        assert sorted(r.request_id for r in aborted) == ["old-0:0", "old-1:0"]
        for r in aborted:
            assert r.finish_reason == "abort" and 10 <= len(r.token_ids) < 5_000
            assert r.token_ids == expected_ids(r.request_id, len(r.token_ids))  # exactly what was sampled
            assert len(r.token_versions) == len(r.token_ids) and r.token_versions[0] == 0
        assert [await t for t in turns] == sorted(
            aborted, key=lambda r: r.request_id
        )  # generate returns the same
        kept = await asyncio.wait_for(fresh_turn, 20)  # all of version 1: not aborted
        assert kept.finish_reason != "abort" and set(kept.token_versions) == {1}
        await wait_work_queue_empty(nc)
    finally:
        await client.close()
        await e.stop()


async def test_garbage_in_the_policy_bucket_is_refused_counted_and_answered(nats_server, nc) -> None:
    """Bad input from a writer with the right to write (hostile bytes, a wrong schema, an out-of-range version)
    never reaches the engine's weights: it is logged, counted and answered on `ns.errors`; a trainer then
    overwrites it, and garbage on the status subject is counted by the client, never believed."""
    e = agent(nats_server.url, "mix-g")
    await e.start()
    errors: list[proto.ErrorReply] = []

    async def on_error(msg: Any) -> None:
        errors.append(proto.decode_as(msg.data, proto.ErrorReply, msg.subject))

    await nc.subscribe(S.errors, cb=on_error)
    client = await RolloutClient.connect(nats_server.url)
    try:
        kv = await nc.jetstream().key_value(S.policy_bucket)
        await kv.put("current", b'{"type":"policy_version_update","schema_version":2,"version":-3,"ts_s":0}')
        await kv.put("paused", b"\xff\xfe not json")
        await wait_until(lambda: len(errors) == 2)
        assert sorted((x.kind, x.field) for x in errors) == [("decode", ""), ("decode", "version")]
        assert e.policy_version == 0 and e.bad_input == 2 and not e.weights.state.paused
        await nc.publish(S.policy_status("mix-g"), b'{"type":"weights_status","engine_id":"mix-g"}')
        await wait_until(lambda: client.control.bad_messages == 1)
        ack = await client.update_weights(1, timeout_s=10)  # the trainer overwrites the garbage
        assert ack.engines == {"mix-g": 1}
    finally:
        await client.close()
        await e.stop()

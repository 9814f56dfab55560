"""TrackerService against a real nats-server: snapshots, bad bytes, and a restart that rebuilds the same state."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import nats
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

import proto
from prorsa.bench.synthetic import SyntheticWorkload, generate_events
from proto import (
    ENGINE_EVENT_MESSAGES,
    LIFECYCLE_MESSAGES,
    EngineEvent,
    LifecycleSnapshot,
    PrefillDone,
    Subjects,
    TrajectoryStarted,
    TurnSubmitted,
)
from services.runtime.nats_server import EmbeddedNatsServer
from services.trajectory_tracker.core import TrackerCore
from services.trajectory_tracker.service import TrackerService

S = Subjects()


async def _publish(js, events: list) -> int:  # noqa: ANN001
    """Publish events into the EVENTS stream; returns the last stream sequence."""
    seq = 0
    for ev in events:
        subject = S.engine_events(ev.engine_id) if isinstance(ev, EngineEvent) else S.lifecycle
        ack = await js.publish(subject, proto.encode(ev))
        seq = ack.seq
    return seq


async def _wait_for(cond: Callable[[], bool], timeout_s: float = 8.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_snapshots_follow_the_events_and_bad_bytes_do_not_crash(
    nats_server: EmbeddedNatsServer, nc
) -> None:  # noqa: ANN001
    svc = TrackerService(nats_server.url, snapshot_interval_s=0.1)
    await svc.start()
    snapshots: list[LifecycleSnapshot] = []

    async def on_snap(msg) -> None:  # noqa: ANN001
        snapshots.append(proto.decode_as(msg.data, LifecycleSnapshot))

    await nc.subscribe(S.snapshot, cb=on_snap)
    js = nc.jetstream()
    try:
        await js.publish(S.lifecycle, b"this is not json")
        await js.publish(S.engine_events("e1"), b'{"type": "prefill_done"}')
        await _publish(
            js,
            [
                TrajectoryStarted(traj_id="a", ts_s=0.0, source="c", seq=1, task="math", prompt_tokens=10),
                TurnSubmitted(
                    traj_id="a", ts_s=0.0, source="c", seq=2, turn=0, request_id="a:0", prompt_tokens=10
                ),
                PrefillDone(
                    engine_id="e1",
                    ts_s=0.0,
                    seq=1,
                    request_id="a:0",
                    traj_id="a",
                    turn=0,
                    new_tokens=10,
                    cached_tokens=0,
                ),
                TrajectoryStarted(traj_id="b", ts_s=0.0, source="c", seq=3, task="code"),
            ],
        )
        await _wait_for(lambda: bool(snapshots) and snapshots[-1].counts["decode"] == 1)
        snap = snapshots[-1]
        assert snap.counts == {"queued": 1, "prefill": 0, "decode": 1, "tool_call": 0}
        assert snap.counts_by_task == {
            "math": {"queued": 0, "prefill": 0, "decode": 1, "tool_call": 0},
            "code": {"queued": 1, "prefill": 0, "decode": 0, "tool_call": 0},
        }
        assert {f.traj_id: f.state for f in snap.trajectories} == {"a": "decode", "b": "queued"}
        assert svc.metrics.error_counts.get("decode", 0) == 2
        # an event for a trajectory nobody started is bad input, counted, and the service carries on
        await _publish(
            js,
            [
                PrefillDone(
                    engine_id="e1",
                    ts_s=0.0,
                    seq=2,
                    request_id="z:0",
                    traj_id="z",
                    turn=0,
                    new_tokens=1,
                    cached_tokens=0,
                )
            ],
        )
        await _wait_for(lambda: svc.metrics.error_counts.get("unknown_trajectory", 0) == 1)
        assert svc.health_details()["live"] == 2
    finally:
        await svc.stop()


async def _stream_events(url: str) -> list[tuple[int, float, object]]:
    """Every event in the EVENTS stream as (stream seq, storage time, event), like a fresh tracker sees them."""
    conn = await nats.connect(url)
    js = conn.jetstream()
    cfg = ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, filter_subjects=S.events_stream_subjects
    )
    sub = await js.pull_subscribe(S.lifecycle, stream=S.events_stream, config=cfg)
    out = []
    info = await js.stream_info(S.events_stream)
    while len(out) < info.state.messages:
        for m in await sub.fetch(500, timeout=2):
            ev = proto.decode(m.data, m.subject, (*LIFECYCLE_MESSAGES, *ENGINE_EVENT_MESSAGES))
            out.append((m.metadata.sequence.stream, m.metadata.timestamp.timestamp(), ev))
    await conn.close()
    return out


def _reference_digest(stream: list, upto_seq: int) -> str:
    core = TrackerCore()
    for seq, now, ev in stream:
        if seq <= upto_seq:
            core.apply(ev, now)
    return core.state_digest()


async def test_a_restarted_tracker_rebuilds_the_same_state(nats_server: EmbeddedNatsServer, nc) -> None:  # noqa: ANN001
    events = [ev for _, ev in generate_events(SyntheticWorkload(trajectories=40, turns_mean=4, seed=11))]
    again = events[::7]
    events += again  # redeliveries: the same (source, seq) again
    half = len(events) // 2
    js = nc.jetstream()
    first = TrackerService(nats_server.url, snapshot_interval_s=0.2, fetch_batch=16)
    await first.start()
    await _publish(js, events[:half])
    # Kill it mid-run: more events keep arriving while it is being stopped.
    publishing = asyncio.create_task(_publish(js, events[half:]))
    await _wait_for(lambda: first.last_stream_seq > half)
    await first.stop()
    last_seq = await publishing
    stopped_at = first.last_stream_seq
    assert 0 < stopped_at <= last_seq

    second = TrackerService(nats_server.url, snapshot_interval_s=0.2)
    await second.start()
    try:
        await _wait_for(lambda: second.last_stream_seq == last_seq and second.caught_up)
        stream = await _stream_events(nats_server.url)
        assert len(stream) == last_seq
        # The first instance's state was exactly that of a core fed the stream up to where it stopped...
        assert first.core.state_digest() == _reference_digest(stream, stopped_at)
        # ...and the new instance, replaying everything, has exactly the full stream's state.
        assert second.core.state_digest() == _reference_digest(stream, last_seq)
        assert second.core.rejections == {"duplicate": len(again)}
        assert second.core.totals["finished"] == 40 and second.core.live_count == 0
    finally:
        await second.stop()

"""Tracker checkpoints against a real nats-server: an instance restored from a checkpoint and one that replays the
whole EVENTS stream reach the same state; checkpoints that are corrupt, of another schema or of another stream
are counted and ignored (a full replay), never fatal."""

from __future__ import annotations

import msgspec

import proto
from prorsa.bench.synthetic import SyntheticWorkload, generate_events
from proto import Subjects, TurnSubmitted
from services.runtime.bus import ensure_streams
from services.runtime.nats_server import EmbeddedNatsServer
from services.trajectory_tracker import checkpoint as ckpt
from services.trajectory_tracker.checkpoint_store import CheckpointStore
from services.trajectory_tracker.service import TrackerService
from tests.test_tracker_service import _publish, _wait_for

S = Subjects()
# The first instance's checkpoint timer never fires in these tests: its checkpoint is the one a graceful stop writes.
NEVER_S = 3600.0


def _events(seed: int) -> list:
    events = [ev for _, ev in generate_events(SyntheticWorkload(trajectories=30, turns_mean=4, seed=seed))]
    return events + events[::11]  # redeliveries by the senders: duplicates, counted in the state


async def _caught_up(svc: TrackerService, last_seq: int) -> None:
    await _wait_for(lambda: svc.last_stream_seq == last_seq and svc.caught_up, timeout_s=30)


def _view(svc: TrackerService) -> tuple:
    """What the state is, for comparing two instances (snapshot numbering aside)."""
    snap = svc.core.snapshot(svc.core.clock_s + 1.0)
    return svc.core.state_digest(), msgspec.json.encode(msgspec.structs.replace(snap, seq=0))


async def test_a_restored_tracker_equals_a_full_replay(nats_server: EmbeddedNatsServer, nc) -> None:  # noqa: ANN001
    js = nc.jetstream()
    events = _events(seed=5)
    half = len(events) // 2
    first = TrackerService(nats_server.url, snapshot_interval_s=0.2, checkpoint_interval_s=NEVER_S)
    await first.start()
    try:
        seq = await _publish(js, events[:half])
        await _caught_up(first, seq)
        assert first.restored_from_seq is None  # nothing to restore: it replayed the (short) stream
    finally:
        await first.stop()  # graceful: writes a checkpoint of everything applied
    assert first.checkpoints_saved >= 1 and first.checkpoint_seq == seq
    last_seq = await _publish(js, events[half:])

    restored = TrackerService(nats_server.url, snapshot_interval_s=0.2)
    full = TrackerService(nats_server.url, snapshot_interval_s=0.2, checkpoint_interval_s=None)
    await restored.start()
    await full.start()
    try:
        await _caught_up(restored, last_seq)
        await _caught_up(full, last_seq)
        assert restored.restored_from_seq == seq
        assert restored.events_applied == last_seq - seq  # only what came after the checkpoint
        assert full.restored_from_seq is None and full.events_applied == last_seq
        assert _view(restored) == _view(full)
        assert (
            restored.core.rejections.get("duplicate", 0) > 0
        )  # the senders' duplicates, on both sides alike
        # It keeps checkpointing: a later instance starts from the new checkpoint.
        assert await restored.save_checkpoint() and restored.checkpoint_seq == last_seq
    finally:
        await restored.stop()
        await full.stop()
    third = TrackerService(nats_server.url, snapshot_interval_s=0.2)
    await third.start()
    try:
        await _caught_up(third, last_seq)
        assert third.restored_from_seq == last_seq and third.events_applied == 0
        assert _view(third) == _view(full)
    finally:
        await third.stop()


async def _put(nc, data: bytes) -> None:  # noqa: ANN001
    store = CheckpointStore(nc.jetstream(), S.tracker_checkpoint_bucket)
    await store.open()
    await store.save(data)


async def _start_from(url: str, last_seq: int) -> TrackerService:
    svc = TrackerService(url, snapshot_interval_s=0.2)
    await svc.start()
    await _caught_up(svc, last_seq)
    return svc


async def test_unusable_checkpoints_are_counted_and_ignored(nats_server: EmbeddedNatsServer, nc) -> None:  # noqa: ANN001
    js = nc.jetstream()
    last_seq = await _publish(js, _events(seed=6))
    reference = TrackerService(nats_server.url, snapshot_interval_s=0.2, checkpoint_interval_s=None)
    await reference.start()
    await _caught_up(reference, last_seq)
    await reference.stop()
    info = await js.stream_info(S.events_stream)
    good = ckpt.capture(reference.core, last_seq, str(info.created))
    cases = {
        "corrupt": ckpt.encode(good)[:-7],
        "schema": ckpt.encode(msgspec.structs.replace(good, schema=ckpt.SCHEMA + 1)),
        "stream": ckpt.encode(
            msgspec.structs.replace(good, stream_seq=last_seq + 100)
        ),  # ahead of the stream
    }
    for kind, data in cases.items():
        await _put(nc, data)
        svc = await _start_from(nats_server.url, last_seq)
        try:
            assert svc.checkpoints_refused == {kind: 1}, kind
            assert svc.metrics.error_counts.get(f"checkpoint_{kind}") == 1
            assert svc.restored_from_seq is None and svc.events_applied == last_seq  # a full replay instead
            assert _view(svc) == _view(reference)
            assert svc.health_status == "ok"
        finally:
            await svc.stop()  # writes a good checkpoint over the bad one


async def test_a_checkpoint_of_a_recreated_stream_is_ignored(nats_server: EmbeddedNatsServer, nc) -> None:  # noqa: ANN001
    js = nc.jetstream()
    first = TrackerService(nats_server.url, snapshot_interval_s=0.2, checkpoint_interval_s=NEVER_S)
    await first.start()
    seq = await _publish(js, _events(seed=7))
    await _caught_up(first, seq)
    await first.stop()
    assert first.checkpoint_seq == seq
    # The stream is deleted and made again (an operator's reset), and more than the old sequence is published:
    # only the creation time tells the checkpoint is of the old stream.
    await js.delete_stream(S.events_stream)
    await ensure_streams(js, S)
    last_seq = await _publish(js, _events(seed=8) * 2)
    assert last_seq > seq
    svc = await _start_from(nats_server.url, last_seq)
    try:
        assert svc.checkpoints_refused == {"stream": 1} and svc.restored_from_seq is None
        assert svc.events_applied == last_seq
    finally:
        await svc.stop()


async def test_hostile_counts_neither_stop_the_tracker_nor_its_checkpoints(
    nats_server: EmbeddedNatsServer, nc
) -> None:  # noqa: ANN001
    """A 30-digit count decodes (the wire has no upper bound) but fits no int64 column nor msgpack: the core
    refuses it (huge_count), so the state stays encodable and checkpoints go on (the fault campaign's flood)."""
    js = nc.jetstream()
    svc = TrackerService(nats_server.url, snapshot_interval_s=0.2, checkpoint_interval_s=NEVER_S)
    await svc.start()
    try:
        events = _events(seed=9)
        first = events[0]
        huge = 10**30
        await _publish(js, [events[0]])  # the trajectory starts
        hostile = TurnSubmitted(
            traj_id=first.traj_id, ts_s=0.0, source="h", turn=0, request_id="h:0", prompt_tokens=huge
        )
        await js.publish(S.lifecycle, proto.encode(hostile))
        last_seq = await _publish(js, events)
        await _caught_up(svc, last_seq)
        assert svc.core.rejections.get("huge_count") == 1
        assert await svc.save_checkpoint() and svc.checkpoint_seq == last_seq
        assert svc.health_status == "ok" and not svc.failed_tasks
    finally:
        await svc.stop()

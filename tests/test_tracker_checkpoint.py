"""Tracker checkpoints, pure: a core restored from a checkpoint and fed the rest of the events is the core that saw
them all (digest, snapshots, columns); bytes that are not a usable checkpoint are refused with a kind."""

from __future__ import annotations

import msgspec
import pytest

from prorsa.bench.synthetic import SyntheticWorkload, generate_events
from services.trajectory_tracker import checkpoint as ckpt
from services.trajectory_tracker.core import TrackerConfig, TrackerCore

# Small bounds, so that the dedupe windows prune and the recently-ended set evicts within the test.
CONFIG = TrackerConfig(dedupe_window=64, max_sources=8, recent_ended=30)


def _events() -> list[tuple[float, object]]:
    events = generate_events(SyntheticWorkload(trajectories=60, turns_mean=4, tasks=("a", "b", "c"), seed=3))
    return events + events[::9]  # redeliveries: duplicates and late events, counted as rejections


def _snapshot_without_seq(core: TrackerCore, now: float) -> bytes:
    snap = core.snapshot(now)
    return msgspec.json.encode(msgspec.structs.replace(snap, seq=0))


def _roundtrip(core: TrackerCore, seq: int = 7) -> TrackerCore:
    data = ckpt.encode(ckpt.capture(core, seq, "created-at"))
    back = ckpt.decode(data)
    assert back.stream_seq == seq and back.stream_created == "created-at"
    return ckpt.restore(back, CONFIG)


@pytest.mark.parametrize("split", [0, 1, 40, 400, 1500, -1])
def test_a_restored_core_continues_exactly_like_the_original(split: int) -> None:
    events = _events()
    split = len(events) if split == -1 else split
    whole = TrackerCore(CONFIG)
    for now, ev in events[:split]:
        whole.apply(ev, now)
    restored = _roundtrip(whole)
    assert restored.state_digest() == whole.state_digest()
    for now, ev in events[split:]:
        assert restored.apply(ev, now) == whole.apply(ev, now)
    end = events[-1][0] + 1.0
    assert restored.state_digest() == whole.state_digest()
    assert _snapshot_without_seq(restored, end) == _snapshot_without_seq(whole, end)
    a, b = restored.columns(end), whole.columns(end)
    assert a.task_names == b.task_names and a.seq == b.seq
    assert a.traj_ids.tolist() == b.traj_ids.tolist() and a.task.tolist() == b.task.tolist()
    assert restored.expire(end + 1e6) == whole.expire(end + 1e6)
    assert restored.state_digest() == whole.state_digest()


def test_a_checkpoint_of_a_fresh_core_restores_a_fresh_core() -> None:
    restored = _roundtrip(TrackerCore(CONFIG))
    assert restored.state_digest() == TrackerCore(CONFIG).state_digest()


def test_what_is_not_a_usable_checkpoint_is_refused_with_its_kind() -> None:
    core = TrackerCore(CONFIG)
    for now, ev in _events()[:300]:
        core.apply(ev, now)
    good = ckpt.capture(core, 5, "x")
    data = ckpt.encode(good)
    cases = {
        "corrupt": [
            b"",
            b"not a checkpoint",
            data[: len(data) // 2],
            ckpt.zlib.compress(b"\x93\x01\x02"),
            ckpt.encode(msgspec.structs.replace(good, counts=[1, 2])),
            ckpt.encode(msgspec.structs.replace(good, live=[good.live[0], good.live[0]])),
        ],
        "schema": [ckpt.encode(msgspec.structs.replace(good, schema=ckpt.SCHEMA + 1))],
    }
    for kind, blobs in cases.items():
        for blob in blobs:
            with pytest.raises(ckpt.CheckpointError) as err:
                ckpt.restore(ckpt.decode(blob), CONFIG)
            assert err.value.kind == kind, blob[:40]
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.restore(ckpt.decode(data), TrackerConfig(dedupe_window=65, max_sources=8, recent_ended=30))
    assert err.value.kind == "config"


def test_a_checkpoint_of_ten_thousand_live_trajectories_is_small() -> None:
    from proto import TrajectoryStarted, TurnSubmitted

    core = TrackerCore()
    for i in range(10_000):
        core.apply(
            TrajectoryStarted(traj_id=f"t-{i:06d}", ts_s=0.0, source="c", seq=2 * i + 1, task="x"), float(i)
        )
        core.apply(
            TurnSubmitted(
                traj_id=f"t-{i:06d}",
                ts_s=0.0,
                source="c",
                seq=2 * i + 2,
                turn=0,
                request_id="r",
                prompt_tokens=9,
            ),
            float(i),
        )
    data = ckpt.encode(ckpt.capture(core, 20_000, "x"))
    # The object store chunks it anyway; this keeps the write every few seconds cheap.
    assert len(data) < 1_000_000, len(data)
    assert ckpt.restore(ckpt.decode(data), TrackerConfig()).state_digest() == core.state_digest()


def test_the_checkpoint_module_is_pure() -> None:
    import ast
    from pathlib import Path

    tree = ast.parse(Path(ckpt.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"asyncio", "nats", "time", "random"}, imported

"""TrackerCore.columns / LiveColumns: the columnar snapshot equals the object snapshot built the old way (walking
the live map), through arrivals, finishes, losses, compaction and growth; numbers on the wire are plain Python."""

from __future__ import annotations

import numpy as np

import proto
from prorsa.bench.synthetic import SyntheticWorkload, generate_events
from proto import LifecycleSnapshot, TrajectoryFeatures, TrajectoryStarted, TurnSubmitted
from services.trajectory_tracker.columns import LiveColumns
from services.trajectory_tracker.core import TrackerConfig, TrackerCore


def reference_snapshot(core: TrackerCore, now: float, seq: int) -> LifecycleSnapshot:
    """The object snapshot as TrackerCore built it before the columns existed (one walk over the live map)."""
    bound = now - core.config.silent_after_s
    feats = [
        TrajectoryFeatures(
            traj_id=t.traj_id,
            task=t.task,
            state=t.state,
            time_in_state_s=max(0.0, now - t.entered_s),
            turn=t.turn,
            context_tokens=t.prompt_tokens + t.generated,
            generated_this_turn=t.generated,
            tool=t.tool,
            policy_version=t.policy_version,
            silent=t.last_event_s < bound,
        )
        for t in core._live.values()
    ]
    by_state: dict[str, int] = {}
    ctx: dict[str, int] = {}
    by_task: dict[str, dict[str, int]] = {}
    for t in core._live.values():
        by_state[t.state] = by_state.get(t.state, 0) + 1
        ctx[t.state] = ctx.get(t.state, 0) + t.prompt_tokens + t.generated
        d = by_task.setdefault(t.task, dict.fromkeys(("queued", "prefill", "decode", "tool_call"), 0))
        d[t.state] += 1
    states = ("queued", "prefill", "decode", "tool_call")
    return LifecycleSnapshot(
        ts_s=now,
        seq=seq,
        counts={s: by_state.get(s, 0) for s in states},
        counts_by_task=by_task,
        context_tokens_by_state={s: ctx.get(s, 0) for s in states},
        trajectories=feats,
        finished_total=core.totals["finished"],
        aborted_total=core.totals["aborted"],
        lost_total=core.totals["lost"],
        started_total=core.totals["started"],
        silent_total=sum(f.silent for f in feats),
    )


def _replay(
    trajectories: int,
    spread_s: float,
    seed: int,
    config: TrackerConfig | None = None,
    turns_mean: float = 6.0,
) -> int:
    """Replay a synthetic stream, checking snapshot == reference every half second; returns snapshots checked."""
    core = TrackerCore(config)
    core._columns = LiveColumns(capacity=16)  # small arrays: the run grows and compacts them many times
    events = generate_events(
        SyntheticWorkload(
            trajectories=trajectories, arrival_spread_s=spread_s, seed=seed, turns_mean=turns_mean
        )
    )
    checked, next_s = 0, 0.5
    for t, ev in events:
        while t >= next_s:
            core.expire(next_s)
            snap = core.snapshot(next_s)
            assert snap == reference_snapshot(core, next_s, snap.seq)
            checked += 1
            next_s += 0.5
        core.apply(ev, t)
    assert core.live_count == 0
    assert core.columns(next_s).n == 0
    return checked


def test_columns_follow_the_live_map_through_a_whole_run() -> None:
    assert _replay(300, 20.0, seed=5) > 20


def test_silence_and_losses_match_the_reference() -> None:
    # short silence and loss bounds: trajectories are flagged silent and expired (lost) mid-run
    assert _replay(60, 4.0, seed=6, config=TrackerConfig(silent_after_s=0.4, lost_after_s=1.2)) > 5


def test_growth_keeps_order_and_values() -> None:
    core = TrackerCore()
    for i in range(3000):  # beyond the initial capacity, no finishes: the arrays grow
        core.apply(
            TrajectoryStarted(traj_id=f"g{i}", ts_s=0.0, task=f"task{i % 3}", prompt_tokens=i), i * 0.01
        )
        if i % 2:
            core.apply(
                TurnSubmitted(traj_id=f"g{i}", ts_s=0.0, turn=1, request_id="r", prompt_tokens=i + 7),
                i * 0.01,
            )
    cols = core.columns(40.0)
    assert cols.traj_ids.tolist() == [f"g{i}" for i in range(3000)]
    assert cols.context_tokens.tolist() == [i + 7 if i % 2 else i for i in range(3000)]
    assert [cols.task_names[c] for c in cols.task[:4].tolist()] == ["task0", "task1", "task2", "task0"]
    assert cols.time_in_state_s[0] == 40.0 and cols.time_in_state_s.min() >= 0.0
    assert core.snapshot(40.0) == reference_snapshot(core, 40.0, 2)


def test_columns_are_copies_and_snapshot_numbers_are_python() -> None:
    core = TrackerCore()
    core.apply(TrajectoryStarted(traj_id="a", ts_s=0.0, task="t", prompt_tokens=10), 1.0)
    cols = core.columns(2.0)
    cols.context_tokens[0] = 999  # the caller owns the copy
    snap = core.snapshot(2.5)
    assert snap.trajectories[0].context_tokens == 10
    assert type(snap.ts_s) is float and type(snap.trajectories[0].time_in_state_s) is float
    assert type(snap.trajectories[0].turn) is int and type(snap.trajectories[0].silent) is bool
    assert proto.decode_as(proto.encode(snap), LifecycleSnapshot) == snap
    assert cols.seq == 1 and snap.seq == 2


def test_compaction_renumbers_slots_in_order() -> None:
    class R:
        def __init__(self, i: int) -> None:
            self.slot, self.traj_id, self.task, self.state = -1, f"r{i}", "x", "queued"
            self.entered_s = self.last_event_s = float(i)
            self.turn = self.prompt_tokens = self.generated = self.policy_version = i
            self.tool = ""

    cols = LiveColumns(capacity=16)
    rows = [R(i) for i in range(16)]
    for r in rows:
        cols.allocate(r)
        cols.write(r)
    for r in rows[:12]:
        cols.release(r)
    extra = R(99)
    cols.allocate(extra)  # full and 3/4 holes: compacts instead of growing
    cols.write(extra)
    assert [r.slot for r in rows[12:]] == [0, 1, 2, 3] and extra.slot == 4
    out = cols.take(100.0, 30.0, seq=1, counts={}, counts_by_task={}, context_tokens_by_state={})
    assert out.traj_ids.tolist() == ["r12", "r13", "r14", "r15", "r99"]
    assert out.turn.tolist() == [12, 13, 14, 15, 99]
    assert np.array_equal(out.silent, [True, True, True, True, False])
    assert out.silent_total == 4


def test_a_replay_compacts() -> None:
    compactions = 0
    original = LiveColumns._compact

    def counting(self: LiveColumns) -> None:
        nonlocal compactions
        compactions += 1
        original(self)

    LiveColumns._compact = counting  # type: ignore[method-assign]
    try:
        _replay(100, 40.0, seed=7, turns_mean=1.5)  # short trajectories: arrivals keep coming as many end
    finally:
        LiveColumns._compact = original  # type: ignore[method-assign]
    assert compactions > 0

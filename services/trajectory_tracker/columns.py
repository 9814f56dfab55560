"""The live trajectories' features as columns (numpy arrays), so a snapshot is a few array copies. Pure.

Why: a snapshot of 10,000 live trajectories built as 10,000 `TrajectoryFeatures` objects, which the forecaster
then turns back into arrays, costs tens of milliseconds per tick in Python. Here every live trajectory owns a slot
(a row index) in a set of parallel arrays; the core writes a trajectory's row after each event that changed it, and
`LiveColumns.take(...)` copies the live rows out.

Slots are allocated in arrival order and never reused out of order: a finished trajectory leaves a hole, and when
the arrays are full and at least half of them are holes, the live rows are compacted in place (order kept). So the
live rows, read in slot order, are in the order the trajectories started — the live map's order — and the
columnar snapshot lists trajectories in exactly the order of the object snapshot (`SnapshotColumns.to_snapshot`).
Compaction renumbers slots (O(live) once per doubling of arrivals: amortised O(1) per trajectory).

Codes: `state` is an index into `state_names` (the tracker's live states), `task` an index into `task_names`
(every task name the tracker has seen, in first-seen order; codes are stable for the core's lifetime).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from proto import LifecycleSnapshot, TrajectoryFeatures
from services.trajectory_tracker import table as tb

STATE_NAMES: tuple[str, ...] = tb.LIVE_STATES
STATE_CODE: dict[str, int] = {s: i for i, s in enumerate(STATE_NAMES)}

# (column name, dtype) of the numeric columns; traj ids and tools are object columns.
_NUMERIC: tuple[tuple[str, Any], ...] = (
    ("state", np.int8),
    ("task", np.int32),
    ("entered_s", np.float64),
    ("last_event_s", np.float64),
    ("turn", np.int64),
    ("context_tokens", np.int64),
    ("generated", np.int64),
    ("policy_version", np.int64),
)


class Row(Protocol):
    """What a live trajectory record exposes to the columns (the core's `_Traj`)."""

    slot: int
    traj_id: str
    task: str
    state: str
    entered_s: float
    last_event_s: float
    turn: int
    prompt_tokens: int
    generated: int
    tool: str
    policy_version: int


@dataclass(frozen=True, slots=True)
class SnapshotColumns:
    """One snapshot as columns: row i of every array is one live trajectory, in the live map's order.

    The arrays are copies (the caller may keep or modify them). Field names follow `TrajectoryFeatures` and
    `LifecycleSnapshot`."""

    ts_s: float
    seq: int
    state_names: tuple[str, ...]  # state code -> name
    task_names: tuple[str, ...]  # task code -> name (may name tasks with no live trajectory)
    traj_ids: np.ndarray  # (n,) object: str
    task: np.ndarray  # (n,) int32 code into task_names
    state: np.ndarray  # (n,) int8 code into state_names
    time_in_state_s: np.ndarray  # (n,) float64 seconds, >= 0
    turn: np.ndarray  # (n,) int64
    context_tokens: np.ndarray  # (n,) int64 prompt + generated tokens
    generated_this_turn: np.ndarray  # (n,) int64 output tokens of the current turn
    policy_version: np.ndarray  # (n,) int64
    silent: np.ndarray  # (n,) bool: no event for longer than the tracker's silence bound
    tool: np.ndarray  # (n,) object: str
    counts: dict[str, int]  # state -> live trajectories
    counts_by_task: dict[str, dict[str, int]]  # task -> state -> count
    context_tokens_by_state: dict[str, int]
    finished_total: int = 0
    aborted_total: int = 0
    lost_total: int = 0
    silent_total: int = 0
    started_total: int = 0

    @property
    def n(self) -> int:
        return len(self.state)

    def to_snapshot(self) -> LifecycleSnapshot:
        """The wire message (per-trajectory objects; plain Python numbers, which msgspec can encode)."""
        states, tasks = self.state_names, self.task_names
        new = TrajectoryFeatures
        feats = [
            new(
                traj_id=tid,
                task=tasks[task],
                state=states[state],  # type: ignore[arg-type]
                time_in_state_s=tis,
                turn=turn,
                context_tokens=ctx,
                generated_this_turn=gen,
                tool=tool,
                policy_version=pv,
                silent=silent,
            )
            for tid, task, state, tis, turn, ctx, gen, tool, pv, silent in zip(
                self.traj_ids.tolist(),
                self.task.tolist(),
                self.state.tolist(),
                self.time_in_state_s.tolist(),
                self.turn.tolist(),
                self.context_tokens.tolist(),
                self.generated_this_turn.tolist(),
                self.tool.tolist(),
                self.policy_version.tolist(),
                self.silent.tolist(),
                strict=True,
            )
        ]
        return LifecycleSnapshot(
            ts_s=float(self.ts_s),
            seq=self.seq,
            counts=dict(self.counts),
            counts_by_task={task: dict(c) for task, c in self.counts_by_task.items()},
            context_tokens_by_state=dict(self.context_tokens_by_state),
            trajectories=feats,
            finished_total=self.finished_total,
            aborted_total=self.aborted_total,
            lost_total=self.lost_total,
            silent_total=self.silent_total,
            started_total=self.started_total,
        )


class LiveColumns:
    """Slot-indexed arrays of the live trajectories (see the module header). Public: allocate, write, release,
    take, task_names."""

    def __init__(self, capacity: int = 1024) -> None:
        self._cap = max(16, capacity)
        self._hi = 0  # slots [0, hi) were handed out; holes among them are dead
        self._dead = 0
        self._alive = np.zeros(self._cap, dtype=bool)
        self._owner: list[Row | None] = [None] * self._cap
        self._num = {name: np.zeros(self._cap, dtype=dt) for name, dt in _NUMERIC}
        self._arrays = tuple(self._num.values())  # the same arrays in _NUMERIC order, unpacked by `write`
        self._ids = np.empty(self._cap, dtype=object)
        self._tool = np.empty(self._cap, dtype=object)
        self._task_code: dict[str, int] = {}

    @property
    def task_names(self) -> tuple[str, ...]:
        return tuple(self._task_code)

    def add_task_names(self, names: list[str]) -> None:
        """Give these task names the next codes, in order (a restored core's columns: codes as they were)."""
        for name in names:
            self._task_code.setdefault(name, len(self._task_code))

    def allocate(self, row: Row) -> int:
        """A slot for a new live trajectory, after every live one (sets `row.slot`; write its fields next)."""
        if self._hi == self._cap:
            if 2 * self._dead >= self._cap:
                self._compact()
            else:
                self._grow()
        i = row.slot = self._hi
        self._hi += 1
        self._alive[i] = True
        self._owner[i] = row
        self._ids[i] = row.traj_id
        return i

    def write(self, row: Row) -> None:
        """Copy a live trajectory's fields into its row (after every change to them)."""
        # Runs once per applied event: plain tuple unpacking, no lookups by name.
        i = row.slot
        state, task, entered_s, last_event_s, turn, context, generated, policy_version = self._arrays
        code = self._task_code.get(row.task)
        if code is None:
            code = self._task_code[row.task] = len(self._task_code)
        state[i] = STATE_CODE[row.state]
        task[i] = code
        entered_s[i] = row.entered_s
        last_event_s[i] = row.last_event_s
        turn[i] = row.turn
        context[i] = row.prompt_tokens + row.generated
        generated[i] = row.generated
        policy_version[i] = row.policy_version
        self._tool[i] = row.tool

    def release(self, row: Row) -> None:
        """The trajectory left the live map: its slot becomes a hole."""
        i = row.slot
        self._alive[i] = False
        self._owner[i] = None
        self._ids[i] = self._tool[i] = None
        self._dead += 1

    def _live_index(self) -> np.ndarray | slice:
        return slice(0, self._hi) if self._dead == 0 else np.flatnonzero(self._alive[: self._hi])

    def _grow(self) -> None:
        cap = 2 * self._cap
        for name, a in self._num.items():
            self._num[name] = np.concatenate([a, np.zeros(cap - len(a), dtype=a.dtype)])
        self._arrays = tuple(self._num.values())
        self._alive = np.concatenate([self._alive, np.zeros(cap - self._cap, dtype=bool)])
        self._ids = np.concatenate([self._ids, np.empty(cap - self._cap, dtype=object)])
        self._tool = np.concatenate([self._tool, np.empty(cap - self._cap, dtype=object)])
        self._owner.extend([None] * (cap - self._cap))
        self._cap = cap

    def _compact(self) -> None:
        """Move the live rows to the front, in order, and renumber their owners' slots."""
        keep = np.flatnonzero(self._alive[: self._hi])
        k = len(keep)
        for a in (*self._num.values(), self._ids, self._tool):
            a[:k] = a[keep]
            a[k:] = 0 if a.dtype != object else None
        owners = [self._owner[i] for i in keep.tolist()]
        self._owner = [*owners, *([None] * (self._cap - k))]
        for j, row in enumerate(owners):
            assert row is not None
            row.slot = j
        self._alive[:k] = True
        self._alive[k:] = False
        self._hi, self._dead = k, 0

    def take(self, now: float, silent_after_s: float, **totals: Any) -> SnapshotColumns:
        """Copies of the live rows at `now`. `totals`: the snapshot-level fields of `SnapshotColumns` (seq,
        counts, counts_by_task, context_tokens_by_state, finished_total, ... silent_total is computed here)."""
        idx, num = self._live_index(), self._num
        tis = now - num["entered_s"][idx]
        np.maximum(tis, 0.0, out=tis)
        silent = num["last_event_s"][idx] < now - silent_after_s
        return SnapshotColumns(
            ts_s=now,
            state_names=STATE_NAMES,
            task_names=self.task_names,
            traj_ids=self._ids[idx].copy(),
            task=num["task"][idx].copy(),
            state=num["state"][idx].copy(),
            time_in_state_s=tis,
            turn=num["turn"][idx].copy(),
            context_tokens=num["context_tokens"][idx].copy(),
            generated_this_turn=num["generated"][idx].copy(),
            policy_version=num["policy_version"][idx].copy(),
            silent=silent,
            tool=self._tool[idx].copy(),
            silent_total=int(np.count_nonzero(silent)),
            **totals,
        )

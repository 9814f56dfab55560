"""TrackerCore: the live lifecycle of every trajectory, built from client lifecycle and engine events. Pure.

Theory of operation
- `apply(event, now)` takes one lifecycle event (TrajectoryStarted, TurnSubmitted, ToolCallStarted,
  ToolCallFinished, TrajectoryFinished) or engine event (PrefillDone, TokenProgress, RequestFinished,
  RequestFailed) and returns the list of `Rejection`s it caused (empty when it applied cleanly). It never raises on
  bad input and never leaves a trajectory half-updated: every check runs before any field changes.
- State changes follow the table in `table.py`; turn numbers make it tolerant of reordering between sources
  (see that module's header). A duplicate — the same (source, seq) for lifecycle events, (engine_id, seq) for
  engine events, within a bounded window — changes nothing. Unnumbered events (seq 0) rely on the table's
  idempotence; token counts only ever grow within a turn.
- `now` is the caller's clock (the live service uses the EVENTS stream's storage timestamp, so a replay of the
  stream rebuilds exactly the same state; the simulator uses virtual time). A `now` older than the newest seen is
  counted as `clock_backwards` and the event applied at the newest time (time never runs backwards inside).
- Silence: a live trajectory with no event for more than `silent_after_s` is flagged `silent` in snapshots; after
  `lost_after_s`, `expire(now)` marks it `lost`. Lost, finished and aborted trajectories are folded into per-task
  aggregates and removed; their ids stay in a bounded recently-ended set so a late event counts as `late`, not
  `unknown_trajectory`.
- Memory: the live map holds only live trajectories; dedupe windows, recently-ended ids and histograms are bounded.
- Columns: every live trajectory's snapshot fields are also kept in numpy columns (`columns.py`), written after
  each change, so `columns(now)` is a few array copies; `snapshot(now)` is built from them (same order and values).

Rejection kinds: duplicate, stale (older turn), late (trajectory already ended) — benign, expected under
redelivery and reordering; unknown_trajectory, impossible_transition, negative_tokens, huge_count (a count above
`MAX_COUNT`: it fits no int64 column nor a checkpoint), clock_backwards, bad_time
(non-finite now), bad_timestamp (tool finished before it started), unsupported_event — bad input from a peer.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from proto import (
    EngineEvent,
    LifecycleEvent,
    LifecycleSnapshot,
    PrefillDone,
    RequestFailed,
    RequestFinished,
    TokenProgress,
    ToolCallFinished,
    ToolCallStarted,
    TrajectoryFeatures,
    TrajectoryFinished,
    TrajectoryStarted,
    TurnSubmitted,
)
from services.trajectory_tracker import table as tb
from services.trajectory_tracker.aggregates import TaskAggregates
from services.trajectory_tracker.columns import LiveColumns, SnapshotColumns
from services.trajectory_tracker.dedupe import SeqDeduper

BENIGN_KINDS = frozenset({"duplicate", "stale", "late"})
# The largest token count, turn or sequence number the core takes (2^40, a trillion). The wire allows any
# non-negative integer; a 30-digit one from a hostile peer used to overflow the int64 columns half-way through an
# update (and a checkpoint, msgpack, holds no integer beyond 64 bits, nor sums of many of them).
MAX_COUNT = 2**40


@dataclass(frozen=True, slots=True)
class Rejection:
    """One problem with one event. `kind` is one of the module header's kinds."""

    kind: str
    traj_id: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class TrackerConfig:
    silent_after_s: float = 30.0  # no event for this long: flagged silent in snapshots
    lost_after_s: float = 600.0  # no event for this long: `expire()` marks the trajectory lost
    dedupe_window: int = 4096  # sequence numbers remembered per source
    max_sources: int = 4096  # sources (clients + engines) remembered for dedupe
    recent_ended: int = 100_000  # ended trajectory ids remembered to classify late events

    def __post_init__(self) -> None:
        if not (0 < self.silent_after_s <= self.lost_after_s):
            raise ValueError("need 0 < silent_after_s <= lost_after_s")


class _Traj:
    """Mutable per-trajectory record (slots: ~10k of them are walked per snapshot)."""

    __slots__ = (
        "traj_id",
        "task",
        "policy_version",
        "state",
        "entered_s",
        "last_event_s",
        "turn",
        "prompt_tokens",
        "generated",
        "tool",
        "tool_started_ts",
        "new_recorded_turn",
        "output_recorded_turn",
        "turns_submitted",
        "slot",
    )

    def __init__(self, traj_id: str, now: float) -> None:
        self.traj_id = traj_id
        self.task = ""
        self.policy_version = 0
        self.state = tb.QUEUED
        self.entered_s = now
        self.last_event_s = now
        self.turn = 0
        self.prompt_tokens = 0  # whole context sent with the current turn
        self.generated = 0  # output tokens of the current turn (final once in tool_call)
        self.tool = ""
        self.tool_started_ts: float | None = None  # sender clock, for tool latency
        self.new_recorded_turn = -1  # turn whose new-prompt-token count is already in the aggregates
        self.output_recorded_turn = -1
        self.turns_submitted = 0
        self.slot = -1  # row in the core's LiveColumns (renumbered when they compact)

    def key(self) -> tuple[Any, ...]:
        """Everything the trajectory's state is (its column slot is storage, not state)."""
        return tuple(getattr(self, s) for s in self.__slots__[:-1])


_KIND_OF: dict[type, str] = {
    TurnSubmitted: tb.TURN_SUBMITTED,
    ToolCallStarted: tb.TOOL_STARTED,
    ToolCallFinished: tb.TOOL_FINISHED,
    PrefillDone: tb.PREFILL_DONE,
    RequestFinished: tb.REQUEST_FINISHED,
    RequestFailed: tb.REQUEST_FAILED,
}


class TrackerCore:
    """See the module header. Public: apply, expire, snapshot, features, aggregates, state_digest."""

    def __init__(self, config: TrackerConfig | None = None) -> None:
        self.config = config or TrackerConfig()
        self._live: dict[str, _Traj] = {}
        self._columns = LiveColumns()
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._dedupe = SeqDeduper(self.config.dedupe_window, self.config.max_sources)
        self._aggregates: dict[str, TaskAggregates] = {}
        self._clock = -math.inf
        self._snapshot_seq = 0
        self.rejections: dict[str, int] = {}
        self._counts: dict[str, int] = dict.fromkeys(tb.LIVE_STATES, 0)
        self._context: dict[str, int] = dict.fromkeys(tb.LIVE_STATES, 0)
        self._by_task: dict[str, dict[str, int]] = {}
        self.totals: dict[str, int] = {"started": 0, "finished": 0, "aborted": 0, "lost": 0, "events": 0}
        # Cumulative demand actually seen (tokens): new prompt tokens submitted, output tokens generated.
        self.prefill_tokens_total = 0
        self.decode_tokens_total = 0

    # --- input ------------------------------------------------------------------------------------------------
    def apply(self, event: Any, now: float) -> list[Rejection]:
        """Apply one lifecycle or engine event observed at `now` (seconds). Returns the rejections it caused."""
        traj_id = str(getattr(event, "traj_id", ""))
        if not math.isfinite(now):
            return self._rejected([Rejection("bad_time", traj_id, f"non-finite now {now!r}")])
        out: list[Rejection] = []
        if now < self._clock:
            out.append(
                Rejection("clock_backwards", traj_id, f"now {now} < {self._clock}; applied at {self._clock}")
            )
            now = self._clock
        self._clock = now
        problem = self._admit(event, traj_id)
        if problem is not None:
            out.append(problem)
            return self._rejected(out)
        self.totals["events"] += 1
        if isinstance(event, TokenProgress):
            for item in event.items:
                out.extend(self._apply_one(tb.TOKEN_PROGRESS, item.traj_id, item.turn, item, now))
        elif isinstance(event, TrajectoryStarted):
            out.extend(self._apply_one(tb.STARTED, traj_id, None, event, now))
        elif isinstance(event, TrajectoryFinished):
            kind = tb.TRAJ_ABORTED if event.status == "aborted" else tb.TRAJ_FINISHED
            out.extend(self._apply_one(kind, traj_id, None, event, now))
        else:
            out.extend(self._apply_one(_KIND_OF[type(event)], traj_id, event.turn, event, now))
        return self._rejected(out)

    def _admit(self, event: Any, traj_id: str) -> Rejection | None:
        """Type, token-count and duplicate checks, before anything changes."""
        if isinstance(event, LifecycleEvent) and (
            type(event) in _KIND_OF or isinstance(event, TrajectoryStarted | TrajectoryFinished)
        ):
            source = "client:" + event.source
        elif isinstance(event, EngineEvent) and (type(event) in _KIND_OF or isinstance(event, TokenProgress)):
            source = "engine:" + event.engine_id
        else:
            return Rejection("unsupported_event", traj_id, type(event).__name__)
        bad = _bad_count_field(event)
        if bad:
            return Rejection("negative_tokens" if "=-" in bad else "huge_count", traj_id, bad)
        if not self._dedupe.check_and_add(source, event.seq):
            return Rejection("duplicate", traj_id, f"{source} seq {event.seq}")
        return None

    def _rejected(self, rejections: list[Rejection]) -> list[Rejection]:
        for r in rejections:
            self.rejections[r.kind] = self.rejections.get(r.kind, 0) + 1
        return rejections

    def _apply_one(self, kind: str, traj_id: str, turn: int | None, ev: Any, now: float) -> list[Rejection]:
        t = self._live.get(traj_id)
        if t is None:
            if traj_id in self._ended:
                return [Rejection("late", traj_id, f"{kind} after {self._ended[traj_id]}")]
            if kind != tb.STARTED:
                return [Rejection("unknown_trajectory", traj_id, kind)]
            t = self._live[traj_id] = _Traj(traj_id, now)
            self.totals["started"] += 1
            self._columns.allocate(t)
            self._track(t)
        if turn is not None and turn < t.turn:
            return [Rejection("stale", traj_id, f"{kind} for turn {turn} < current turn {t.turn}")]
        try:
            new_state = tb.next_state(tb.PREFILL if turn is not None and turn > t.turn else t.state, kind)
        except tb.TransitionError as err:
            return [Rejection("impossible_transition", traj_id, str(err))]
        self._untrack(t)
        if turn is not None and turn > t.turn:
            self._advance(t, turn, now)
        out = self._effect(kind, t, ev)
        if new_state != t.state:
            t.state = new_state
            t.entered_s = now
        t.last_event_s = now
        if new_state in tb.TERMINAL_STATES:
            self._fold(t, new_state)
        else:
            self._track(t)
        return out

    # Counts and context totals by state and task, and the columns, are kept up to date here, so a snapshot does
    # not recount them: every mutation of a live trajectory happens between `_untrack` and `_track`.
    def _track(self, t: _Traj, sign: int = 1) -> None:
        if sign > 0:
            self._columns.write(t)
        self._counts[t.state] += sign
        self._context[t.state] += sign * (t.prompt_tokens + t.generated)
        by_task = self._by_task.get(t.task)
        if by_task is None:
            by_task = self._by_task[t.task] = dict.fromkeys(tb.LIVE_STATES, 0)
        by_task[t.state] += sign
        if sign < 0 and not any(by_task.values()):
            del self._by_task[t.task]

    def _untrack(self, t: _Traj) -> None:
        self._track(t, -1)

    def _advance(self, t: _Traj, turn: int, now: float) -> None:
        """A newer turn was submitted (its TurnSubmitted is late or lost): start it in prefill."""
        t.prompt_tokens += t.generated  # the context so far: a lower bound until the prompt size is known
        t.turn = turn
        t.generated = 0
        t.tool = ""
        t.tool_started_ts = None
        t.state = tb.PREFILL
        t.entered_s = now

    def _effect(self, kind: str, t: _Traj, ev: Any) -> list[Rejection]:
        """Field updates of one event (the state change is the caller's)."""
        if kind == tb.TOKEN_PROGRESS or kind == tb.REQUEST_FINISHED:
            self._grow_output(t, ev.output_tokens)
            if kind == tb.REQUEST_FINISHED:
                t.prompt_tokens = max(t.prompt_tokens, ev.prompt_tokens)
                if t.output_recorded_turn < t.turn:
                    t.output_recorded_turn = t.turn
                    self._agg(t.task).output_tokens_per_turn.add(ev.output_tokens)
        elif kind == tb.TURN_SUBMITTED:
            self._turn_submitted(t, ev)
        elif kind == tb.PREFILL_DONE:
            t.prompt_tokens = max(t.prompt_tokens, ev.new_tokens + ev.cached_tokens)
        elif kind == tb.REQUEST_FAILED:
            if t.state == tb.DECODE:
                t.generated = 0  # the retry generates the turn again
        elif kind == tb.TOOL_STARTED:
            t.tool = ev.tool or t.tool
            if t.tool_started_ts is None:
                t.tool_started_ts = ev.ts_s
        elif kind == tb.TOOL_FINISHED:
            return self._tool_finished(t, ev)
        elif kind == tb.STARTED:
            t.task = ev.task or t.task
            t.policy_version = ev.policy_version
            if t.state == tb.QUEUED and ev.prompt_tokens:
                t.prompt_tokens = ev.prompt_tokens
        else:  # trajectory finished / aborted
            turns = ev.turns or t.turns_submitted
            self._agg(t.task).turns_per_trajectory.add(turns)
        return []

    def _grow_output(self, t: _Traj, output_tokens: int) -> None:
        if output_tokens > t.generated:
            self.decode_tokens_total += output_tokens - t.generated
            t.generated = output_tokens

    def _turn_submitted(self, t: _Traj, ev: TurnSubmitted) -> None:
        if t.new_recorded_turn >= ev.turn:  # already counted (an unnumbered duplicate)
            t.prompt_tokens = max(t.prompt_tokens, ev.prompt_tokens)
            return
        if ev.new_tokens > 0:
            new = ev.new_tokens
        elif ev.turn == 0 or t.turns_submitted == 0:
            new = ev.prompt_tokens
        else:
            new = max(0, ev.prompt_tokens - t.prompt_tokens)  # prompt_tokens holds the previous context here
        t.new_recorded_turn = ev.turn
        t.turns_submitted += 1
        t.prompt_tokens = max(t.prompt_tokens, ev.prompt_tokens)
        self.prefill_tokens_total += new
        self._agg(t.task).new_prompt_tokens_per_turn.add(new)

    def _tool_finished(self, t: _Traj, ev: ToolCallFinished) -> list[Rejection]:
        t.tool = ev.tool or t.tool
        started, t.tool_started_ts = t.tool_started_ts, None
        if started is None:
            return []
        latency_s = ev.ts_s - started
        if not (latency_s >= 0.0) or math.isinf(latency_s):
            return [
                Rejection("bad_timestamp", t.traj_id, f"tool finished {ev.ts_s} before it started {started}")
            ]
        self._agg(t.task).tool_latency_s.add(latency_s)
        return []

    def _agg(self, task: str) -> TaskAggregates:
        a = self._aggregates.get(task)
        if a is None:
            a = self._aggregates[task] = TaskAggregates()
        return a

    def _fold(self, t: _Traj, state: str) -> None:
        self._agg(t.task).count_end(state)
        self.totals[state] += 1
        del self._live[t.traj_id]
        self._columns.release(t)
        self._ended[t.traj_id] = state
        if len(self._ended) > self.config.recent_ended:
            self._ended.popitem(last=False)

    # --- time -------------------------------------------------------------------------------------------------
    def expire(self, now: float) -> list[str]:
        """Mark trajectories silent for longer than `lost_after_s` as lost (folded, removed); returns their ids."""
        if not math.isfinite(now):
            return []
        bound = now - self.config.lost_after_s
        lost = [t for t in self._live.values() if t.last_event_s < bound]
        for t in lost:
            self._untrack(t)
            self._agg(t.task).turns_per_trajectory.add(t.turns_submitted)
            self._fold(t, tb.LOST)
        return [t.traj_id for t in lost]

    # --- output -----------------------------------------------------------------------------------------------
    def snapshot(self, now: float) -> LifecycleSnapshot:
        """Counts, context tokens and per-trajectory features at `now` (does not change the state).

        The wire form of `columns(now)` (same numbering: each call takes the next snapshot seq)."""
        return self.columns(now).to_snapshot()

    def columns(self, now: float) -> SnapshotColumns:
        """The snapshot at `now` as numpy columns, trajectories in the same order as `snapshot(now)`: the fast
        in-process path (a few array copies for 10,000 live trajectories). Does not change the state."""
        self._snapshot_seq += 1
        return self._columns.take(
            now,
            self.config.silent_after_s,
            seq=self._snapshot_seq,
            counts=dict(self._counts),
            counts_by_task={task: dict(c) for task, c in self._by_task.items()},
            context_tokens_by_state=dict(self._context),
            finished_total=self.totals["finished"],
            aborted_total=self.totals["aborted"],
            lost_total=self.totals["lost"],
            started_total=self.totals["started"],
        )

    def features(self, traj_id: str, now: float) -> TrajectoryFeatures | None:
        """One live trajectory's features (None when not live)."""
        t = self._live.get(traj_id)
        if t is None:
            return None
        return TrajectoryFeatures(
            traj_id=t.traj_id,
            task=t.task,
            state=t.state,  # type: ignore[arg-type]
            time_in_state_s=max(0.0, now - t.entered_s),
            turn=t.turn,
            context_tokens=t.prompt_tokens + t.generated,
            generated_this_turn=t.generated,
            tool=t.tool,
            policy_version=t.policy_version,
            silent=t.last_event_s < now - self.config.silent_after_s,
        )

    def ended_state(self, traj_id: str) -> str | None:
        """The terminal state of a recently ended trajectory (None if live or unknown)."""
        return self._ended.get(traj_id)

    @property
    def live_count(self) -> int:
        return len(self._live)

    @property
    def clock_s(self) -> float:
        return self._clock

    def aggregates(self) -> dict[str, TaskAggregates]:
        """Per-task aggregates of ended trajectories and completed turns (live objects: do not mutate)."""
        return self._aggregates

    def state_digest(self) -> str:
        """A hash of everything the core knows (live map, aggregates, totals, dedupe windows, counters).

        Two cores fed the same events at the same times have the same digest; snapshot numbering is excluded."""
        parts = (
            sorted(t.key() for t in self._live.values()),
            list(self._ended.items()),
            sorted((k, a.state()) for k, a in self._aggregates.items()),
            sorted(self.rejections.items()),
            sorted(self.totals.items()),
            self._dedupe.state(),
            self._clock,
            self.prefill_tokens_total,
            self.decode_tokens_total,
        )
        return hashlib.sha256(repr(parts).encode()).hexdigest()


_TOKEN_FIELDS = (
    "prompt_tokens",
    "new_tokens",
    "cached_tokens",
    "output_tokens",
    "observation_tokens",
    "turn",
    "seq",
)


def _bad_count_field(event: Any) -> str:
    """`name=value` of a count field that is negative or above MAX_COUNT ("" when none). msgspec checks the sign
    on decode, but in-process callers bypass decoding, and the wire sets no upper bound."""
    for name in _TOKEN_FIELDS:
        v = getattr(event, name, 0)
        if isinstance(v, int) and not 0 <= v <= MAX_COUNT:
            return f"{name}={v}"
    for item in getattr(event, "items", ()) or ():
        for name in ("output_tokens", "turn"):
            v = getattr(item, name, 0)
            if not 0 <= v <= MAX_COUNT:
                return f"items.{name}={v}"
    return ""

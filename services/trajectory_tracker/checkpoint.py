"""Checkpoints of a TrackerCore: its whole state as bytes, and back. Pure (no I/O, no clock).

Why. A restarted tracker rebuilds its state from the EVENTS stream. Replaying the stream from its first message
took 20-30 s after a quarter of an hour of rollout (docs/benchmarks.md, "Fault campaign"); with a checkpoint it
replays only the events after the one the checkpoint reflects. The shell (`checkpoint_store.py`, `service.py`)
stores `encode(...)` on the bus and hands `decode(...)` the bytes it finds; this module never sees the bus.

Exactness. The core's state is a function of the events and their `now` (the stream's storage times), so a core
restored from a checkpoint of stream sequence S and then fed the events after S is the core a full replay builds:
same `state_digest`, same snapshots. That holds because `restore` reproduces every order the output depends on,
not just the contents: the live map's order (= snapshot order), the per-task counts' order, the columns' task
codes (first seen first), the recently-ended ids' LRU order, the dedupe windows' LRU order, and the snapshot seq.
What it does not keep is storage: a restored core's columns are compact (no holes), which changes no output.

Format. zlib-compressed msgpack of `Checkpoint`; the rows are array-like Structs (a trajectory is ~60 bytes
before compression). `SCHEMA` is bumped on every change of this layout or of what the core keeps; a checkpoint of
another schema is refused (the tracker replays the stream from the start instead), so there is no migration code.

Errors: `decode` and `restore` raise `CheckpointError(kind, detail)` for bytes that are not a usable checkpoint:
kind "corrupt" (not zlib/msgpack/the schema's shape, or values the core cannot hold), "schema" (another version),
"config" (the core's bounds differ, so the windows would not be the ones the events built); `check_stream` raises
kind "stream" for a checkpoint of another EVENTS stream (recreated since) or ahead of this one (purged, reset).
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict

import msgspec

from services.trajectory_tracker import table as tb
from services.trajectory_tracker.aggregates import LogHistogram, TaskAggregates
from services.trajectory_tracker.core import TrackerConfig, TrackerCore, _Traj
from services.trajectory_tracker.dedupe import SeqDeduper

SCHEMA = 1
_LEVEL = 1  # zlib level: the ids compress well already at 1, and a checkpoint is taken every few seconds


class CheckpointError(ValueError):
    """Bytes that are not a usable checkpoint; `kind` is "corrupt", "schema" or "config" (see the module doc)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class _TrajRow(msgspec.Struct, array_like=True, frozen=True):
    """One live trajectory: the fields of `core._Traj` in its slot order (its column slot excluded)."""

    traj_id: str
    task: str
    policy_version: int
    state: str
    entered_s: float
    last_event_s: float
    turn: int
    prompt_tokens: int
    generated: int
    tool: str
    tool_started_ts: float | None
    new_recorded_turn: int
    output_recorded_turn: int
    turns_submitted: int


_TRAJ_FIELDS = _TrajRow.__struct_fields__


class _Hist(msgspec.Struct, array_like=True, frozen=True):
    total: int
    sum: float
    counts: list[int]  # every bucket, underflow first (the bucket layout is the aggregates' fixed one)


class _Agg(msgspec.Struct, array_like=True, frozen=True):
    task: str
    finished: int
    aborted: int
    lost: int
    hists: list[_Hist]  # in `_HISTS` order


_HISTS = ("output_tokens_per_turn", "new_prompt_tokens_per_turn", "tool_latency_s", "turns_per_trajectory")


class _Source(msgspec.Struct, array_like=True, frozen=True):
    name: str
    high: int
    seen: list[int]


class Checkpoint(msgspec.Struct, kw_only=True, frozen=True):
    """A core's state plus where in the EVENTS stream it stands. Per-state lists follow `table.LIVE_STATES`."""

    schema: int
    stream_seq: int  # the last EVENTS stream sequence the state reflects (replay from stream_seq + 1)
    stream_created: (
        str  # the EVENTS stream's creation time as the server reports it: a recreated stream differs
    )
    bounds: tuple[int, int, int]  # config: dedupe_window, max_sources, recent_ended
    clock_s: float  # the core's clock (-inf before any event)
    snapshot_seq: int
    live: list[_TrajRow]  # in the live map's order
    task_names: list[str]  # the columns' task codes, in code order
    ended: list[tuple[str, str]]  # recently ended (traj id, terminal state), oldest first
    dedupe: list[_Source]  # least recently used first
    aggregates: list[_Agg]  # in the core's order
    counts: list[int]
    context: list[int]
    by_task: list[tuple[str, list[int]]]  # in the core's order
    rejections: dict[str, int]
    totals: dict[str, int]
    prefill_tokens_total: int
    decode_tokens_total: int


class _Head(msgspec.Struct):
    schema: int  # read first, so a checkpoint of another schema is named as such, not as corrupt


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Checkpoint)
_HEAD = msgspec.msgpack.Decoder(_Head)


def _bounds(config: TrackerConfig) -> tuple[int, int, int]:
    return (config.dedupe_window, config.max_sources, config.recent_ended)


def capture(core: TrackerCore, stream_seq: int, stream_created: str) -> Checkpoint:
    """The core's state now (a copy: later events do not change it), as reflecting stream events <= stream_seq."""
    by_state = tb.LIVE_STATES
    return Checkpoint(
        schema=SCHEMA,
        stream_seq=stream_seq,
        stream_created=stream_created,
        bounds=_bounds(core.config),
        clock_s=core._clock,
        snapshot_seq=core._snapshot_seq,
        live=[_TrajRow(*t.key()) for t in core._live.values()],
        task_names=list(core._columns.task_names),
        ended=list(core._ended.items()),
        dedupe=[_Source(name, high, sorted(seen)) for name, high, seen in core._dedupe.windows()],
        aggregates=[
            _Agg(
                task,
                a.finished,
                a.aborted,
                a.lost,
                [_Hist(h.total, h.sum, list(h.counts)) for h in (getattr(a, n) for n in _HISTS)],
            )
            for task, a in core._aggregates.items()
        ],
        counts=[core._counts[s] for s in by_state],
        context=[core._context[s] for s in by_state],
        by_task=[(task, [c[s] for s in by_state]) for task, c in core._by_task.items()],
        rejections=dict(core.rejections),
        totals=dict(core.totals),
        prefill_tokens_total=core.prefill_tokens_total,
        decode_tokens_total=core.decode_tokens_total,
    )


def encode(checkpoint: Checkpoint) -> bytes:
    return zlib.compress(_ENCODER.encode(checkpoint), _LEVEL)


def decode(data: bytes) -> Checkpoint:
    """The checkpoint in `data`. Raises CheckpointError ("corrupt" or "schema")."""
    try:
        raw = zlib.decompress(data)
    except zlib.error as exc:
        raise CheckpointError("corrupt", f"not zlib data: {exc}") from exc
    try:
        head = _HEAD.decode(raw)
    except msgspec.DecodeError as exc:
        raise CheckpointError("corrupt", f"no schema field: {exc}") from exc
    if head.schema != SCHEMA:
        raise CheckpointError("schema", f"schema {head.schema}, this tracker reads {SCHEMA}")
    try:
        return _DECODER.decode(raw)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise CheckpointError("corrupt", str(exc)) from exc


def check_stream(checkpoint: Checkpoint, stream_created: str, last_seq: int) -> None:
    """Whether the checkpoint belongs to the EVENTS stream as it is now (created then, holding its sequence).
    Raises CheckpointError("stream") when not: replaying after its sequence would skip or repeat events."""
    if checkpoint.stream_created != stream_created:
        raise CheckpointError(
            "stream", f"made on a stream created {checkpoint.stream_created}, this one {stream_created}"
        )
    if checkpoint.stream_seq > last_seq:
        raise CheckpointError("stream", f"at sequence {checkpoint.stream_seq}, the stream ends at {last_seq}")


def restore(checkpoint: Checkpoint, config: TrackerConfig) -> TrackerCore:
    """A core in exactly the checkpoint's state, with `config` (its timeouts may differ from the checkpointed
    core's; its bounds may not). Raises CheckpointError ("config" or "corrupt")."""
    ck = checkpoint
    if ck.bounds != _bounds(config):
        raise CheckpointError("config", f"bounds {ck.bounds}, this tracker has {_bounds(config)}")
    _check(ck)
    core = TrackerCore(config)
    core._clock = ck.clock_s
    core._snapshot_seq = ck.snapshot_seq
    for row in ck.live:
        t = _Traj(row.traj_id, row.entered_s)
        for name in _TRAJ_FIELDS:
            setattr(t, name, getattr(row, name))
        core._live[t.traj_id] = t
    core._columns.add_task_names(ck.task_names)
    for t in core._live.values():  # in live order: the columns then list them in snapshot order
        core._columns.allocate(t)
        core._columns.write(t)
    core._ended = OrderedDict(ck.ended)
    core._dedupe = SeqDeduper.from_windows(
        config.dedupe_window, config.max_sources, [(s.name, s.high, s.seen) for s in ck.dedupe]
    )
    for agg in ck.aggregates:
        core._aggregates[agg.task] = _aggregates(agg)
    states = tb.LIVE_STATES
    core._counts = dict(zip(states, ck.counts, strict=True))
    core._context = dict(zip(states, ck.context, strict=True))
    core._by_task = {task: dict(zip(states, c, strict=True)) for task, c in ck.by_task}
    core.rejections = dict(ck.rejections)
    core.totals = {**core.totals, **ck.totals}
    core.prefill_tokens_total = ck.prefill_tokens_total
    core.decode_tokens_total = ck.decode_tokens_total
    return core


def _check(ck: Checkpoint) -> None:
    """What the schema's types cannot say: values the core could not hold. Raises CheckpointError("corrupt")."""
    n = len(tb.LIVE_STATES)
    problems = [
        ("state", not all(r.state in tb.LIVE_STATES for r in ck.live)),
        ("ended state", not all(s in tb.TERMINAL_STATES for _, s in ck.ended)),
        (
            "per-state list",
            len(ck.counts) != n or len(ck.context) != n or any(len(c) != n for _, c in ck.by_task),
        ),
        (
            "task code",
            not {r.task for r in ck.live} <= set(ck.task_names)
            or len(set(ck.task_names)) != len(ck.task_names),
        ),
        ("duplicate id", len({r.traj_id for r in ck.live}) != len(ck.live)),
        ("clock", math.isnan(ck.clock_s) or ck.clock_s == math.inf),
        ("stream seq", ck.stream_seq < 0),
        ("histograms", not all(len(a.hists) == len(_HISTS) for a in ck.aggregates)),
    ]
    bad = [name for name, failed in problems if failed]
    if bad:
        raise CheckpointError("corrupt", "bad " + ", ".join(bad))


def _aggregates(agg: _Agg) -> TaskAggregates:
    out = TaskAggregates(finished=agg.finished, aborted=agg.aborted, lost=agg.lost)
    for name, h in zip(_HISTS, agg.hists, strict=True):
        hist: LogHistogram = getattr(out, name)
        if len(h.counts) != len(hist.counts) or sum(h.counts) != h.total:
            raise CheckpointError("corrupt", f"histogram {name} of task {agg.task!r} does not fit")
        hist.counts = list(h.counts)
        hist.total = h.total
        hist.sum = h.sum
    return out

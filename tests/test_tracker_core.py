"""TrackerCore: the transition table, idempotence, reordering, silence, bad input, bounded memory."""

from __future__ import annotations

import ast
import inspect
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import services.trajectory_tracker.aggregates as aggregates_mod
import services.trajectory_tracker.core as core_mod
import services.trajectory_tracker.dedupe as dedupe_mod
import services.trajectory_tracker.table as table_mod
from proto import (
    TRAJECTORY_STATES,
    PrefillDone,
    ProgressItem,
    RequestFailed,
    RequestFinished,
    TokenProgress,
    ToolCallFinished,
    ToolCallStarted,
    TrajectoryFinished,
    TrajectoryStarted,
    TurnSubmitted,
)
from services.trajectory_tracker.aggregates import LogHistogram
from services.trajectory_tracker.core import TrackerConfig, TrackerCore
from services.trajectory_tracker.dedupe import SeqDeduper
from services.trajectory_tracker.table import TRANSITIONS, TransitionError, next_state

T = "traj-1"


class Client:
    """Builds lifecycle events with a running per-source sequence number."""

    def __init__(self, source: str = "c1") -> None:
        self.source = source
        self.seq = 0

    def __call__(self, cls: type, **kw: object) -> object:
        self.seq += 1
        kw.setdefault("traj_id", T)
        kw.setdefault("ts_s", 0.0)
        return cls(source=self.source, seq=self.seq, **kw)


def started(c: Client, **kw: object) -> object:
    kw.setdefault("task", "math")
    return c(TrajectoryStarted, prompt_tokens=100, **kw)


def submitted(c: Client, turn: int, prompt: int = 100, new: int = 0) -> object:
    return c(TurnSubmitted, turn=turn, request_id=f"{T}:{turn}", prompt_tokens=prompt, new_tokens=new)


def prefill_done(turn: int, seq: int = 0) -> PrefillDone:
    return PrefillDone(
        engine_id="p1",
        ts_s=0.0,
        seq=seq,
        request_id=f"{T}:{turn}",
        traj_id=T,
        turn=turn,
        new_tokens=100,
        cached_tokens=0,
    )


def progress(turn: int, tokens: int, seq: int = 0) -> TokenProgress:
    item = ProgressItem(request_id=f"{T}:{turn}", traj_id=T, turn=turn, output_tokens=tokens)
    return TokenProgress(engine_id="d1", ts_s=0.0, seq=seq, items=[item])


def finished(turn: int, out: int = 50, seq: int = 0) -> RequestFinished:
    return RequestFinished(
        engine_id="d1",
        ts_s=0.0,
        seq=seq,
        request_id=f"{T}:{turn}",
        traj_id=T,
        turn=turn,
        prompt_tokens=100,
        cached_tokens=0,
        output_tokens=out,
    )


def state(core: TrackerCore, now: float = 0.0) -> str:
    f = core.features(T, now)
    return f.state if f is not None else str(core.ended_state(T))


# --- the table ----------------------------------------------------------------------------------------------------


def test_every_table_entry_names_known_states_and_kinds() -> None:
    for s, row in TRANSITIONS.items():
        assert s in TRAJECTORY_STATES
        for kind, new in row.items():
            assert kind in table_mod.EVENT_KINDS and new in TRAJECTORY_STATES


def test_unknown_pair_raises_an_error_naming_both() -> None:
    with pytest.raises(TransitionError, match="request_failed.*tool_call"):
        next_state("tool_call", "request_failed")
    with pytest.raises(TransitionError, match="tool_call_started.*queued"):
        next_state("queued", "tool_call_started")


def test_cores_import_no_io_or_clock() -> None:
    for mod in (core_mod, table_mod, dedupe_mod, aggregates_mod):
        tree = ast.parse(inspect.getsource(mod))
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {
            n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
        }
        assert not names & {"asyncio", "nats", "time", "random"}, (mod.__name__, names)


# --- lifecycle, as tables of events in -> state expected -----------------------------------------------------------

c = Client()
HAPPY_PATH = [
    (lambda: started(c), "queued"),
    (lambda: submitted(c, 0, 100, 100), "prefill"),
    (lambda: prefill_done(0), "decode"),
    (lambda: progress(0, 10), "decode"),
    (lambda: finished(0, 50), "tool_call"),
    (lambda: c(ToolCallStarted, turn=0, tool="bash"), "tool_call"),
    (lambda: c(ToolCallFinished, turn=0, tool="bash", ts_s=2.0), "tool_call"),
    (lambda: submitted(c, 1, 300, 150), "prefill"),
    (lambda: progress(1, 5), "decode"),
    (lambda: finished(1, 20), "tool_call"),
    (lambda: c(TrajectoryFinished, turns=2), "finished"),
]


def test_happy_path_table() -> None:
    core = TrackerCore()
    for i, (make, expected) in enumerate(HAPPY_PATH):
        assert core.apply(make(), float(i)) == [], i
        assert state(core, float(i)) == expected, i
    assert core.live_count == 0 and core.totals["finished"] == 1
    agg = core.aggregates()["math"]
    assert agg.finished == 1 and agg.output_tokens_per_turn.total == 2
    assert agg.tool_latency_s.total == 1 and agg.turns_per_trajectory.total == 1
    assert core.prefill_tokens_total == 250 and core.decode_tokens_total == 70


def test_features_track_turn_context_and_tool() -> None:
    cl = Client()
    core = TrackerCore()
    for ev in (started(cl), submitted(cl, 0, 100, 100), prefill_done(0), progress(0, 30)):
        core.apply(ev, 1.0)
    f = core.features(T, 3.5)
    assert f is not None
    assert (f.state, f.turn, f.context_tokens, f.generated_this_turn, f.task) == (
        "decode",
        0,
        130,
        30,
        "math",
    )
    assert f.time_in_state_s == pytest.approx(2.5)
    core.apply(finished(0, 40), 4.0)
    core.apply(cl(ToolCallStarted, turn=0, tool="grep"), 4.5)
    f = core.features(T, 6.0)
    assert f is not None and f.state == "tool_call" and f.tool == "grep"
    assert f.time_in_state_s == pytest.approx(
        2.0
    )  # since it left the model (RequestFinished), not since the tool
    assert f.generated_this_turn == 40 and f.context_tokens == 140


@pytest.mark.parametrize(
    "events, expected",
    [
        # RequestFinished before PrefillDone (two engines): stays out of the model.
        ([finished(0), prefill_done(0)], "tool_call"),
        # TokenProgress after RequestFinished never moves it back.
        ([finished(0, 50), progress(0, 10)], "tool_call"),
        # Engine events of a turn whose TurnSubmitted is late: the turn advances implicitly.
        ([prefill_done(1)], "decode"),
        # A late TurnSubmitted of the current turn changes nothing.
        ([prefill_done(0), "submit0"], "decode"),
        # A failed request goes back to prefill (the client retries).
        (
            [
                prefill_done(0),
                RequestFailed(engine_id="d1", ts_s=0.0, request_id=f"{T}:0", traj_id=T, turn=0, error="x"),
            ],
            "prefill",
        ),
    ],
)
def test_reordering_between_sources(events: list, expected: str) -> None:
    cl = Client()
    core = TrackerCore()
    core.apply(started(cl), 0.0)
    core.apply(submitted(cl, 0), 0.0)
    for ev in events:
        ev = submitted(cl, 0) if ev == "submit0" else ev
        assert core.apply(ev, 1.0) == []
    assert state(core) == expected


def test_output_never_shrinks_within_a_turn() -> None:
    cl = Client()
    core = TrackerCore()
    for ev in (started(cl), submitted(cl, 0), progress(0, 40), progress(0, 20)):
        core.apply(ev, 0.0)
    f = core.features(T, 0.0)
    assert f is not None and f.generated_this_turn == 40 and core.decode_tokens_total == 40


# --- idempotence ----------------------------------------------------------------------------------------------------


def test_duplicates_change_nothing() -> None:
    cl = Client()
    core = TrackerCore()
    evs = [
        started(cl),
        submitted(cl, 0, 100, 100),
        prefill_done(0, seq=1),
        progress(0, 10, seq=2),
        finished(0, 50, seq=3),
        cl(ToolCallStarted, turn=0),
    ]
    for i, ev in enumerate(evs):
        core.apply(ev, float(i))
    before = (
        core.snapshot(10.0).trajectories,
        core.aggregates()["math"].state(),
        dict(core.totals),
        core.prefill_tokens_total,
        core.decode_tokens_total,
    )
    for ev in evs:
        assert [x.kind for x in core.apply(ev, 10.0)] == ["duplicate"]
    after = (
        core.snapshot(10.0).trajectories,
        core.aggregates()["math"].state(),
        dict(core.totals),
        core.prefill_tokens_total,
        core.decode_tokens_total,
    )
    assert after == before
    assert core.rejections == {"duplicate": len(evs)}


def test_dedupe_window_is_bounded() -> None:
    d = SeqDeduper(window=8, max_sources=2)
    assert all(d.check_and_add("a", s) for s in range(1, 100))
    assert not d.check_and_add("a", 99) and not d.check_and_add("a", 50)  # in and before the window
    assert d.check_and_add("a", 0) and d.check_and_add("a", 0)  # unnumbered: never a duplicate
    d.check_and_add("b", 1)
    d.check_and_add("c", 1)
    assert len(d) == 2  # "a" evicted
    assert all(len_seen <= 16 for _, _, len_seen in d.state())


# --- silence, lateness, bad input --------------------------------------------------------------------------------


def test_silence_is_flagged_then_lost_is_folded_and_late_events_are_late() -> None:
    core = TrackerCore(TrackerConfig(silent_after_s=10.0, lost_after_s=60.0))
    cl = Client()
    core.apply(started(cl), 0.0)
    core.apply(submitted(cl, 0), 0.0)
    snap = core.snapshot(5.0)
    assert snap.silent_total == 0 and not snap.trajectories[0].silent
    snap = core.snapshot(11.0)
    assert snap.silent_total == 1 and snap.trajectories[0].silent
    assert core.expire(30.0) == []
    assert core.expire(61.0) == [T]
    assert core.live_count == 0 and core.totals["lost"] == 1 and core.aggregates()["math"].lost == 1
    r = core.apply(progress(0, 5), 62.0)
    assert [x.kind for x in r] == ["late"]


@pytest.mark.parametrize(
    "start, make, kind",
    [
        (False, lambda cl: progress(0, 5), "unknown_trajectory"),
        (True, lambda cl: cl(ToolCallStarted, traj_id="other", turn=0), "unknown_trajectory"),
        (True, lambda cl: progress(0, -5), "negative_tokens"),
        (True, lambda cl: submitted(cl, 0, -1), "negative_tokens"),
        (True, lambda cl: progress(0, 10**30), "huge_count"),
        (True, lambda cl: progress(10**30, 5), "huge_count"),
        (True, lambda cl: "not an event", "unsupported_event"),
    ],
)
def test_bad_input_is_counted_and_changes_nothing(start: bool, make, kind: str) -> None:  # noqa: ANN001
    cl = Client()
    core = TrackerCore()
    core.apply(started(cl, traj_id="x"), 1.0)  # the clock is at 1.0 either way
    if start:
        core.apply(started(cl), 1.0)
    before = _observable(core)
    r = core.apply(make(cl), 1.0)
    assert [x.kind for x in r] == [kind]
    assert core.rejections == {kind: 1}
    assert _observable(core) == before


def _observable(core: TrackerCore) -> tuple:
    snap = core.snapshot(1.0)
    aggs = sorted((k, a.state()) for k, a in core.aggregates().items())
    return snap.trajectories, snap.counts_by_task, aggs, core.prefill_tokens_total, core.decode_tokens_total


def test_impossible_transition_and_stale_turn() -> None:
    cl = Client()
    core = TrackerCore()
    core.apply(started(cl), 0.0)
    r = core.apply(cl(ToolCallStarted, turn=0), 1.0)
    assert [x.kind for x in r] == ["impossible_transition"]
    assert "queued" in r[0].detail and "tool_call_started" in r[0].detail
    assert state(core) == "queued"
    core.apply(submitted(cl, 0), 1.0)
    core.apply(finished(0), 1.0)
    r = core.apply(
        RequestFailed(engine_id="d", ts_s=0.0, request_id=f"{T}:0", traj_id=T, turn=0, error="x"), 2.0
    )
    assert [x.kind for x in r] == ["impossible_transition"]
    core.apply(submitted(cl, 1), 3.0)
    r = core.apply(progress(0, 99), 3.0)
    assert [x.kind for x in r] == ["stale"]
    f = core.features(T, 3.0)
    assert f is not None and f.turn == 1 and f.generated_this_turn == 0


def test_clock_going_backwards_is_counted_and_clamped() -> None:
    cl = Client()
    core = TrackerCore()
    core.apply(started(cl), 10.0)
    r = core.apply(submitted(cl, 0), 5.0)
    assert [x.kind for x in r] == ["clock_backwards"]
    assert core.clock_s == 10.0 and state(core) == "prefill"
    assert [x.kind for x in core.apply(progress(0, 1), math.nan)] == ["bad_time"]


def test_tool_finished_before_it_started_is_a_bad_timestamp() -> None:
    cl = Client()
    core = TrackerCore()
    for ev in (started(cl), submitted(cl, 0), finished(0), cl(ToolCallStarted, turn=0, ts_s=5.0)):
        core.apply(ev, 1.0)
    r = core.apply(cl(ToolCallFinished, turn=0, ts_s=4.0), 2.0)
    assert [x.kind for x in r] == ["bad_timestamp"]
    assert core.aggregates()["math"].tool_latency_s.total == 0


# --- memory ---------------------------------------------------------------------------------------------------------


def test_memory_is_bounded_finished_trajectories_leave() -> None:
    core = TrackerCore(TrackerConfig(recent_ended=100))
    for i in range(1000):
        cl = Client(f"c{i % 3}")
        cl.seq = i * 10
        tid = f"t{i}"
        for ev in (
            cl(TrajectoryStarted, traj_id=tid, task="coding"),
            cl(TurnSubmitted, traj_id=tid, turn=0, request_id=f"{tid}:0", prompt_tokens=10),
            cl(TrajectoryFinished, traj_id=tid, turns=1),
        ):
            core.apply(ev, float(i))
    assert core.live_count == 0
    assert len(core._ended) == 100
    assert core.totals["finished"] == 1000 and core.aggregates()["coding"].turns_per_trajectory.total == 1000
    assert core.snapshot(2000.0).counts_by_task == {}


def test_log_histogram_quantiles() -> None:
    h = LogHistogram(1.0, 2.0**20)
    for x in range(1, 1001):
        h.add(float(x))
    assert h.quantile(0.5) == pytest.approx(500, rel=0.1)
    assert h.quantile(0.9) == pytest.approx(900, rel=0.1)
    assert h.mean == pytest.approx(500.5)
    with pytest.raises(ValueError):
        h.add(-1.0)


# --- property: hostile sequences never break the invariants --------------------------------------------------------

TIDS = ["a", "b", "c"]


def _event(kind: int, tid: str, turn: int, n: int, seq: int, src: str):  # noqa: ANN202
    rid = f"{tid}:{turn}"
    return [
        lambda: TrajectoryStarted(traj_id=tid, ts_s=0.0, source=src, seq=seq, task=tid, prompt_tokens=n),
        lambda: TurnSubmitted(
            traj_id=tid, ts_s=0.0, source=src, seq=seq, turn=turn, request_id=rid, prompt_tokens=n
        ),
        lambda: ToolCallStarted(traj_id=tid, ts_s=0.0, source=src, seq=seq, turn=turn),
        lambda: ToolCallFinished(traj_id=tid, ts_s=float(n), source=src, seq=seq, turn=turn),
        lambda: TrajectoryFinished(
            traj_id=tid, ts_s=0.0, source=src, seq=seq, status=("finished", "aborted")[n % 2]
        ),
        lambda: PrefillDone(
            engine_id=src,
            ts_s=0.0,
            seq=seq,
            request_id=rid,
            traj_id=tid,
            turn=turn,
            new_tokens=n,
            cached_tokens=0,
        ),
        lambda: TokenProgress(
            engine_id=src,
            ts_s=0.0,
            seq=seq,
            items=[ProgressItem(request_id=rid, traj_id=tid, turn=turn, output_tokens=n)],
        ),
        lambda: RequestFinished(
            engine_id=src,
            ts_s=0.0,
            seq=seq,
            request_id=rid,
            traj_id=tid,
            turn=turn,
            prompt_tokens=n,
            cached_tokens=0,
            output_tokens=n,
        ),
        lambda: RequestFailed(
            engine_id=src, ts_s=0.0, seq=seq, request_id=rid, traj_id=tid, turn=turn, error="e"
        ),
    ][kind]()


event_st = st.tuples(
    st.integers(0, 8),
    st.sampled_from(TIDS),
    st.integers(0, 3),
    st.integers(-3, 500),  # token counts, sometimes negative (in-process callers bypass msgspec's checks)
    st.integers(0, 6),
    st.sampled_from(["s1", "s2"]),
    st.one_of(st.floats(-5.0, 50.0), st.just(math.nan)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(event_st, max_size=60))
def test_hostile_sequences_keep_the_invariants(events: list) -> None:
    core = TrackerCore(TrackerConfig(silent_after_s=5.0, lost_after_s=20.0, recent_ended=2))
    for kind, tid, turn, n, seq, src, now in events:
        rejections = core.apply(_event(kind, tid, turn, n, seq, src), now)
        assert all(r.kind in REJECTION_KINDS for r in rejections)
        if math.isfinite(now):
            core.expire(now)
        _check_invariants(core)


REJECTION_KINDS = {
    "duplicate",
    "stale",
    "late",
    "unknown_trajectory",
    "impossible_transition",
    "negative_tokens",
    "huge_count",
    "clock_backwards",
    "bad_time",
    "bad_timestamp",
    "unsupported_event",
}


def _check_invariants(core: TrackerCore) -> None:
    now = core.clock_s if math.isfinite(core.clock_s) else 0.0
    snap = core.snapshot(now)
    live = snap.trajectories
    assert len(live) == core.live_count
    assert all(f.state in ("queued", "prefill", "decode", "tool_call") for f in live)
    assert all(f.context_tokens >= 0 and f.generated_this_turn >= 0 and f.time_in_state_s >= 0 for f in live)
    counts = {s: sum(f.state == s for f in live) for s in snap.counts}
    assert counts == snap.counts
    assert all(v >= 0 for v in snap.counts.values()) and all(
        v >= 0 for v in snap.context_tokens_by_state.values()
    )
    ctx = {s: sum(f.context_tokens for f in live if f.state == s) for s in snap.counts}
    assert ctx == snap.context_tokens_by_state
    by_task: dict[str, dict[str, int]] = {}
    for f in live:
        by_task.setdefault(f.task, dict.fromkeys(snap.counts, 0))[f.state] += 1
    assert by_task == snap.counts_by_task
    assert snap.silent_total == sum(f.silent for f in live)
    assert min(core.totals.values()) >= 0 and min(core.rejections.values(), default=0) >= 0

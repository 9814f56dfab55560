"""The simulator's clock: a queue of timed events, and the lifecycle hooks a tracker or forecaster can observe.

An event is a tuple `(kind, a, b)` due at a virtual time. Events at the same time run in the order they were
scheduled, so a run is deterministic. The queue is a binary heap of bare float times plus a dict from time to the
event due then (`due`); the rare later events at an already-scheduled time wait, in order, in `more`. Why not a heap
of `(time, seq, kind, a, b)` tuples: at thousands of pending events (one per trajectory in a tool call) the heap's
tuple comparisons cost about twice as much as float comparisons plus the dict work, and the queue is touched ~11
times per simulated turn. An engine that replans (an admission cuts a decode jump short) bumps its own token and
schedules a new wake-up; the old event stays queued and is ignored when it surfaces (cheaper than deleting it).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any, Protocol

# Event kinds (small ints, dispatched by Simulation.run).
ARRIVAL = 0  # a trajectory's turn is submitted (a: Traj, b: attempt)
ENGINE_WAKE = 1  # an engine's step or decode jump ends (a: SimEngine, b: token)
HANDOFF_ARRIVE = 2  # a KV transfer to a decode engine completes (a: SimEngine, b: Request)
# An engine's switch timer fires: its in-place pause or its restart ends, or its drain bound passes (a: SimEngine,
# b: token; `prorsa.sim.engine_switching`).
RECONFIG_DONE = 3
POLICY_TICK = 4  # the allocator policy decides
TRAINING_DONE = 5  # the trainer finishes a step's batch (a: step index)
END = 6  # the duration cap is reached (due just after it)
DECODE_CHECK = 7  # an idle mixed engine looks at the handoff queue again (a: SimEngine)

# Lifecycle event names passed to `SimObserver.on_event` (fields in the comment).
TRAJECTORY_STARTED = "trajectory_started"  # step, task, policy_version, group, prompt_tokens, turns
TURN_SUBMITTED = "turn_submitted"  # turn, context_tokens, new_tokens
PREFILL_DONE = "prefill_done"  # turn, engine_id, computed_tokens, cached_tokens, migrated
DECODE_STARTED = "decode_started"  # turn, engine_id, output_tokens
DECODE_PROGRESS = "decode_progress"  # turn, engine_id, tokens (decoded so far in this turn), of
TOOL_CALL_START = "tool_call_start"  # turn, latency_s
TOOL_CALL_END = "tool_call_end"  # turn
TRAJECTORY_FINISHED = "trajectory_finished"  # turns, completion_s
TRAJECTORY_ABORTED = "trajectory_aborted"  # reason, policy_version
REQUEST_MIGRATED = "request_migrated"  # turn, engine_id, decoded_tokens


class SimObserver(Protocol):
    """Receives every lifecycle event with the virtual time it happened at."""

    def on_event(self, kind: str, traj_id: str, now: float, **fields: Any) -> None: ...


class EventQueue:
    """Pending events: `heap` of distinct float times, `due[t]` the first event `(kind, a, b)` at time t, and
    `more[t]` the events scheduled at t after it, in scheduling order.

    `push` is a closure (not a method): it is among the most frequent calls of a run. Engines, which schedule on
    every step, inline it (see `SimEngine._schedule`).
    """

    __slots__ = ("heap", "due", "more", "push")

    def __init__(self) -> None:
        self.heap: list[float] = []  # the event loop pops from it directly
        self.due: dict[float, tuple[int, Any, Any]] = {}
        self.more: dict[float, list[tuple[int, Any, Any]]] = {}
        self.push: Callable[..., None] = _pusher(self.heap, self.due, self.more)

    def __deepcopy__(self, memo: dict[int, Any]) -> EventQueue:
        """A fork's queue (`Simulation.fork`): the pending events copied, and a `push` bound to the copies — the
        closure itself would keep pushing into this queue. Registered in `memo` so that engines holding `push`
        get the new one."""
        import copy

        twin = EventQueue.__new__(EventQueue)
        memo[id(self)] = twin
        # Containers and push first, in memo, so that whatever the events reach (engines, the sim) maps to them.
        twin.heap, twin.due, twin.more = list(self.heap), {}, {}
        memo[id(self.heap)], memo[id(self.due)], memo[id(self.more)] = twin.heap, twin.due, twin.more
        twin.push = _pusher(twin.heap, twin.due, twin.more)
        memo[id(self.push)] = twin.push
        for t, event in self.due.items():
            twin.due[t] = copy.deepcopy(event, memo)
        for t, events in self.more.items():
            twin.more[t] = copy.deepcopy(events, memo)
        return twin

    def peek_time(self) -> float:
        return self.heap[0]

    def __len__(self) -> int:
        return len(self.due) + sum(len(v) for v in self.more.values())


def _pusher(
    heap: list[float], due: dict[float, tuple[int, Any, Any]], more: dict[float, list[tuple[int, Any, Any]]]
) -> Callable[..., None]:
    """`push(time_s, kind, a=None, b=None)`: schedule an event (after any already scheduled at `time_s`)."""
    heappush = heapq.heappush

    def push(time_s: float, kind: int, a: Any = None, b: Any = None) -> None:
        if time_s in due:
            more.setdefault(time_s, []).append((kind, a, b))
        else:
            due[time_s] = (kind, a, b)
            heappush(heap, time_s)

    return push


def push_more(
    more: dict[float, list[tuple[int, Any, Any]]], time_s: float, event: tuple[int, Any, Any]
) -> None:
    """Queue `event` behind those already due at `time_s` (the rare tie; callers have checked `time_s in due`)."""
    more.setdefault(time_s, []).append(event)

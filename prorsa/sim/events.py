"""The simulator's clock: a heap of timed events, and the lifecycle hooks a tracker or forecaster can observe.

Events are plain tuples `(time_s, seq, kind, a, b)` on a binary heap; `seq` increases with every push, so events at
the same virtual time run in the order they were scheduled and a run is deterministic. An engine that replans
(an admission cuts a decode jump short) bumps its own token and pushes a new wake-up; the old event stays on the
heap and is ignored when it surfaces (cheaper than deleting from a heap).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

# Event kinds (small ints, dispatched by Simulation.run).
ARRIVAL = 0  # a trajectory's turn is submitted (a: Traj, b: attempt)
ENGINE_WAKE = 1  # an engine's step or decode jump ends (a: SimEngine, b: token)
HANDOFF_ARRIVE = 2  # a KV transfer to a decode engine completes (a: SimEngine, b: Request)
RECONFIG_DONE = 3  # an engine finishes reconfiguring for its new role (a: SimEngine, b: token)
POLICY_TICK = 4  # the allocator policy decides
TRAINING_DONE = 5  # the trainer finishes a step's batch (a: step index)

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
    """A min-heap of `(time_s, seq, kind, a, b)`; ties run in scheduling order.

    `push` is a closure over the heap and a counter (not a method): it is the most frequent call of a run, and
    skipping the attribute updates of a method saves a measurable share of the loop.
    """

    __slots__ = ("heap", "push", "seq")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, Any, Any]] = []  # the event loop pops from it directly
        # Sequence numbers: `next(seq)` (engines that push on every step build the tuple themselves).
        self.seq: Iterator[int] = itertools.count(1)
        self.push: Callable[..., None] = _pusher(self.heap, self.seq.__next__)

    def pop(self) -> tuple[float, int, int, Any, Any]:
        return heapq.heappop(self.heap)

    def peek_time(self) -> float:
        return self.heap[0][0]

    def __len__(self) -> int:
        return len(self.heap)


def _pusher(heap: list, next_seq: Callable[[], int]) -> Callable[..., None]:
    """`push(time_s, kind, a=None, b=None)`: schedule an event on `heap`."""
    heappush = heapq.heappush

    def push(time_s: float, kind: int, a: Any = None, b: Any = None) -> None:
        heappush(heap, (time_s, next_seq(), kind, a, b))

    return push

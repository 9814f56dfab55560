"""The event queue: earliest time first, and events at the same time in the order they were scheduled."""

from __future__ import annotations

import heapq
import random

from prorsa.sim import events as ev
from prorsa.sim.events import EventQueue


def _pop(q: EventQueue) -> tuple[float, list[tuple[int, object, object]]]:
    """The earliest time and every event due then, taken off the queue as `Simulation._loop` takes them."""
    t = heapq.heappop(q.heap)
    return t, [q.due.pop(t), *q.more.pop(t, ())]


def _drain(q: EventQueue) -> list[tuple[float, int, object]]:
    out = []
    while q.heap:
        t, batch = _pop(q)
        out += [(t, kind, a) for kind, a, _ in batch]
    return out


def test_events_come_out_by_time_then_scheduling_order():
    q = EventQueue()
    rng = random.Random(7)
    pushed = []
    for i in range(500):
        t = float(rng.randint(0, 40))  # many ties
        q.push(t, ev.ARRIVAL, i)
        pushed.append((t, i))
    assert len(q) == 500
    got = [(t, a) for t, _, a in _drain(q)]
    assert got == sorted(pushed)  # sorted by (time, push index): ties keep scheduling order
    assert len(q) == 0 and not q.due and not q.more


def test_an_event_scheduled_for_now_while_now_runs_comes_after_the_ones_already_due():
    q = EventQueue()
    q.push(1.0, ev.ARRIVAL, "a")
    q.push(1.0, ev.ARRIVAL, "b")
    q.push(2.0, ev.ARRIVAL, "c")
    t, batch = _pop(q)
    assert (t, [a for _, a, _ in batch]) == (1.0, ["a", "b"])
    q.push(1.0, ev.ARRIVAL, "d")  # scheduled while t = 1.0 runs
    q.push(1.0, ev.ARRIVAL, "e")
    assert [(t, a) for t, _, a in _drain(q)] == [(1.0, "d"), (1.0, "e"), (2.0, "c")]


def test_push_more_appends_behind_the_due_event():
    q = EventQueue()
    q.push(3.0, ev.POLICY_TICK)
    ev.push_more(q.more, 3.0, (ev.ENGINE_WAKE, "engine", 1))
    assert q.peek_time() == 3.0
    assert [k for _, k, _ in _drain(q)] == [ev.POLICY_TICK, ev.ENGINE_WAKE]

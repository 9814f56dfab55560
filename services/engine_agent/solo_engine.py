"""One engine core with its own time and its own KV arrivals: the engine core for drivers that run one engine.

The simulator wakes its engines from one event heap shared by the whole cluster; a driver of a single engine (the
live simulated backend, which paces it on the scaled clock; the calibration replay, which runs it flat out) needs
the same two kinds of events — the core's wake-up and the arrival of a handed-off request's KV — kept in time order
for one engine. `advance(until)` runs them; the core's effects are collected for the driver to act on.

Pure: no clock, no I/O. Times are the engine's modelled seconds.
"""

from __future__ import annotations

import math
from heapq import heappop, heappush

from services.engine_agent.engine_core import CoreSeq, EngineCore
from services.runtime.perf_model import ModelProfile


class SoloEngine(EngineCore):
    """An `EngineCore` whose events (wake-ups, KV arrivals) it runs itself, up to the time it is given."""

    __slots__ = ("now", "_arrivals", "prefilled", "handed_off", "finished")

    def __init__(self, profile: ModelProfile, role: str) -> None:
        super().__init__(profile, role)
        self.now = 0.0  # the engine's time: every call below happens at it, and it never goes back
        self._arrivals: list[tuple[float, int, CoreSeq]] = []  # (when its KV arrives, rid, sequence)
        # Effects since the driver last cleared them: (sequence, time).
        self.prefilled: list[tuple[CoreSeq, float]] = []  # its first output token is out
        self.handed_off: list[tuple[CoreSeq, float]] = []  # prefilled here, to decode elsewhere
        self.finished: list[tuple[CoreSeq, float]] = []  # its last output token is out

    def next_event_s(self) -> float | None:
        """When the next wake-up or KV arrival is due (None: nothing will happen without new work)."""
        wake = self.wake_s
        if self._arrivals:
            arrive = self._arrivals[0][0]
            return arrive if wake is None or arrive < wake else wake
        return wake

    def advance(self, until: float) -> None:
        """Run every KV arrival and wake-up due at or before `until`, in time order (an arrival first on a tie: it
        joins at the boundary either way); the engine's time is then `until` (or later, if it already was)."""
        while True:
            wake = self.wake_s if self.wake_s is not None else math.inf
            if self._arrivals and self._arrivals[0][0] <= wake and self._arrivals[0][0] <= until:
                t, _, seq = heappop(self._arrivals)
                self.now = max(self.now, t)
                self.on_handoff_arrive(seq, self.now)
            elif wake <= until:
                self.now = max(self.now, wake)
                self.on_wake(self.now)
            else:
                break
        self.now = max(self.now, until)

    def submit(self, seq: CoreSeq) -> None:
        """A prompt to prefill here, now."""
        self.enqueue_prefill(seq, self.now)

    def receive(self, seq: CoreSeq) -> float:
        """A prefilled request whose KV is pulled from elsewhere, now; returns when it arrives."""
        return self.accept_handoff(seq, self.now)

    def drop(self, seq: CoreSeq) -> None:
        """Cancel `seq` wherever it is here (its KV is freed at the next step boundary, or on arrival)."""
        seq.cancelled = True
        self.cancel(self.now)

    # -- the core's hooks -------------------------------------------------------------------------------------

    def accept_handoff(self, seq: CoreSeq, now: float) -> float:
        arrive = EngineCore.accept_handoff(self, seq, now)
        heappush(self._arrivals, (arrive, seq.rid, seq))
        return arrive

    def _on_prefill_done(self, seq: CoreSeq, now: float) -> None:
        self.prefilled.append((seq, now))

    def _hand_off(self, seq: CoreSeq, now: float) -> None:
        self.handed_off.append((seq, now))

    def _on_finished(self, seq: CoreSeq, now: float) -> None:
        self.finished.append((seq, now))

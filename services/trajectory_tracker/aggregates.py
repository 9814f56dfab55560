"""What ended trajectories leave behind: counts and per-task histograms in bounded memory.

A trajectory that finishes, aborts or is lost leaves the live map; its figures live on here. Histograms are
log-spaced (a fixed number of buckets per octave between `min_value` and `max_value`, plus an underflow bucket
for values below `min_value`, zero included), so quantiles have a bounded relative error (~9 % at 8 buckets per
octave) whatever the range, and memory does not grow with the number of trajectories.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class LogHistogram:
    """Counts of non-negative values in log-spaced buckets; `quantile` interpolates within a bucket."""

    __slots__ = ("min_value", "max_value", "per_octave", "counts", "total", "sum")

    def __init__(self, min_value: float = 1.0, max_value: float = 2.0**30, per_octave: int = 8) -> None:
        if not (0 < min_value < max_value) or per_octave < 1:
            raise ValueError("need 0 < min_value < max_value and per_octave >= 1")
        self.min_value = min_value
        self.max_value = max_value
        self.per_octave = per_octave
        n = math.ceil(math.log2(max_value / min_value) * per_octave) + 1
        self.counts = [0] * (n + 1)  # [0] is the underflow bucket [0, min_value)
        self.total = 0
        self.sum = 0.0

    def _index(self, x: float) -> int:
        if x < self.min_value:
            return 0
        i = 1 + int(math.log2(x / self.min_value) * self.per_octave)
        return min(i, len(self.counts) - 1)

    def _lower(self, i: int) -> float:
        return 0.0 if i == 0 else self.min_value * 2.0 ** ((i - 1) / self.per_octave)

    def add(self, x: float) -> None:
        """Record one value; negative or non-finite values are the caller's bug and raise ValueError."""
        if not (x >= 0.0) or math.isinf(x):
            raise ValueError(f"histogram value must be finite and >= 0, got {x!r}")
        self.counts[self._index(x)] += 1
        self.total += 1
        self.sum += x

    @property
    def mean(self) -> float:
        return self.sum / self.total if self.total else 0.0

    def quantile(self, q: float) -> float:
        """The q-quantile (0 <= q <= 1), linearly interpolated inside its bucket; 0.0 when empty."""
        if not self.total:
            return 0.0
        target = min(max(q, 0.0), 1.0) * self.total
        seen = 0
        for i, c in enumerate(self.counts):
            if c and seen + c >= target:
                lo, hi = self._lower(i), self._lower(i + 1)
                return lo + (hi - lo) * max(0.0, target - seen) / c
            seen += c
        return self._lower(len(self.counts) - 1)

    def state(self) -> tuple[int, float, tuple[tuple[int, int], ...]]:
        """(total, sum, non-empty buckets) — a compact, comparable form for digests."""
        return self.total, round(self.sum, 6), tuple((i, c) for i, c in enumerate(self.counts) if c)


def _tokens_hist() -> LogHistogram:
    return LogHistogram(1.0, 2.0**24)


def _seconds_hist() -> LogHistogram:
    return LogHistogram(1e-3, 1e5)


def _turns_hist() -> LogHistogram:
    return LogHistogram(1.0, 2.0**16)


@dataclass
class TaskAggregates:
    """Per-task figures of ended trajectories and completed turns (units in the names)."""

    finished: int = 0
    aborted: int = 0
    lost: int = 0
    output_tokens_per_turn: LogHistogram = field(default_factory=_tokens_hist)
    new_prompt_tokens_per_turn: LogHistogram = field(default_factory=_tokens_hist)
    tool_latency_s: LogHistogram = field(default_factory=_seconds_hist)
    turns_per_trajectory: LogHistogram = field(default_factory=_turns_hist)

    def count_end(self, state: str) -> None:
        if state == "finished":
            self.finished += 1
        elif state == "aborted":
            self.aborted += 1
        else:
            self.lost += 1

    def state(self) -> tuple:
        return (
            self.finished,
            self.aborted,
            self.lost,
            self.output_tokens_per_turn.state(),
            self.new_prompt_tokens_per_turn.state(),
            self.tool_latency_s.state(),
            self.turns_per_trajectory.state(),
        )

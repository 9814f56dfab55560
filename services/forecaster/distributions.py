"""Online, per-task empirical distributions of the trajectory lifecycle, in bounded memory.

Each distribution keeps the most recent `capacity` observations (a ring), so it follows drift across RL steps and
its memory does not grow. Every observation is also added to the pooled task "*", which stands in for a task with
too few observations of its own. `freeze()` copies the arrays into an immutable `DistributionsView` that a refit
may read on another thread while new observations keep arriving.

Kinds (units in the names):
  gap_s            time outside the model: from the end of a turn's output (RequestFinished or ToolCallStarted,
                   whichever comes first) to the next TurnSubmitted (outcome "turn") or TrajectoryFinished
                   (outcome "finish"); the outcome is kept alongside (`gap_is_turn`).
  queue_wait_s     TrajectoryStarted -> first TurnSubmitted.
  prefill_wait_s   TurnSubmitted -> PrefillDone (queueing + prefill).
  output_tokens    output tokens per turn (RequestFinished.output_tokens).
  new_tokens       new prompt tokens per turn, turns after the first (the observation size).
  turns            turns per trajectory.

By turn: the per-turn kinds (gap_s, prefill_wait_s, output_tokens, new_tokens) are also kept per (task, turn
bucket), because an agent's turns are not alike: on the SWE trace the observation added per turn falls from ~490
tokens (turns 3-5) to ~185 (turns 40+) while the output per turn grows from ~80 to ~250 tokens, and early in an
RL step every trajectory is at the same few turns. A sample is filed under the turn index of the trajectory when
the quantity began: a gap and the next turn's new tokens under the turn that just ended (what a trajectory in a
tool call after turn k will do next), an output and a prefill wait under their own turn.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from services.forecaster.bounds import Limits
from services.forecaster.steps import StepLearner

POOLED = "*"
KINDS: tuple[str, ...] = ("gap_s", "queue_wait_s", "prefill_wait_s", "output_tokens", "new_tokens", "turns")
TURN_KINDS: tuple[str, ...] = ("gap_s", "prefill_wait_s", "output_tokens", "new_tokens")
# Turn buckets: bucket b holds turns [EDGES[b-1], EDGES[b]) (bucket 0: turn 0; the last: turns 40 and later).
TURN_BUCKET_EDGES: tuple[int, ...] = (1, 3, 6, 10, 20, 40)
TURN_BUCKETS = len(TURN_BUCKET_EDGES) + 1


def turn_bucket(turn: int) -> int:
    """The bucket of a 0-based turn index (see TURN_BUCKET_EDGES)."""
    return bisect.bisect_right(TURN_BUCKET_EDGES, turn)


class SampleRing:
    """The last `capacity` float observations (with an optional parallel boolean), oldest overwritten first."""

    __slots__ = ("_values", "_flags", "_next", "count")

    def __init__(self, capacity: int) -> None:
        self._values = np.zeros(capacity, dtype=np.float64)
        self._flags = np.zeros(capacity, dtype=bool)
        self._next = 0
        self.count = 0  # observations ever added

    def add(self, value: float, flag: bool = True) -> None:
        i = self._next
        self._values[i] = value
        self._flags[i] = flag
        self._next = (i + 1) % len(self._values)
        self.count += 1

    def __len__(self) -> int:
        return min(self.count, len(self._values))

    def values(self) -> np.ndarray:
        return self._values[: len(self)].copy()

    def flags(self) -> np.ndarray:
        return self._flags[: len(self)].copy()


@dataclass(frozen=True)
class TaskSamples:
    """Copied arrays of one task's observations (see the module header for the kinds)."""

    gap_s: np.ndarray
    gap_is_turn: np.ndarray
    queue_wait_s: np.ndarray
    prefill_wait_s: np.ndarray
    output_tokens: np.ndarray
    new_tokens: np.ndarray
    turns: np.ndarray
    # Kinds whose ring is not full yet: their samples are every observation since the start, so together with
    # the ones still in progress they are the whole population (what `impute_censored` relies on).
    filling: frozenset[str] = frozenset()

    def size(self, kind: str) -> int:
        return len(getattr(self, kind))


@dataclass(frozen=True)
class DistributionsView:
    """An immutable copy of all tasks' samples, plus the per-sequence decode rate."""

    tasks: dict[str, TaskSamples] = field(default_factory=dict)
    decode_rate_tokens_per_s: float = 0.0  # 0.0: not observed yet
    version: int = 0  # observations ever added when frozen (a refit can tell whether anything changed)
    # (task, turn bucket) -> the TURN_KINDS samples filed by turn (the other kinds are left empty)
    by_turn: dict[tuple[str, int], TaskSamples] = field(default_factory=dict)

    def for_task(self, task: str) -> TaskSamples | None:
        return self.tasks.get(task)


class Distributions:
    """Per-task sample rings (see the module header) and an EWMA of the per-sequence decode rate."""

    def __init__(self, capacity: int = 2048, rate_alpha: float = 0.05) -> None:
        self.capacity = capacity
        self.rate_alpha = rate_alpha
        self._rings: dict[str, dict[str, SampleRing]] = {}
        self._by_turn: dict[tuple[str, int], dict[str, SampleRing]] = {}
        self.decode_rate_tokens_per_s = 0.0
        self.version = 0
        # (task, kind) rings that hold at least one sample: a kind leaving its prior is worth a refit at once
        self.kinds_seen = 0
        self.steps = StepLearner()  # when the next RL step's first prompts come (steps.py)
        self.limits = Limits()  # the largest values the run has shown: the demand bound's inputs (bounds.py)

    def _ring(self, task: str, kind: str) -> SampleRing:
        rings = self._rings.get(task)
        if rings is None:
            rings = self._rings[task] = {k: SampleRing(self.capacity) for k in KINDS}
        return rings[kind]

    def add(self, task: str, kind: str, value: float, flag: bool = True, turn: int | None = None) -> None:
        """Record one observation for `task` and the pooled task, and with `turn` (a TURN_KINDS sample) for the
        task's turn bucket too. Negative or non-finite values are dropped."""
        if not (value >= 0.0) or not np.isfinite(value):
            return
        ring = self._ring(task, kind)
        if ring.count == 0:
            self.kinds_seen += 1
        ring.add(value, flag)
        if task != POOLED:
            self._ring(POOLED, kind).add(value, flag)
        if turn is not None and kind in TURN_KINDS:
            key = (task, turn_bucket(max(0, turn)))
            rings = self._by_turn.get(key)
            if rings is None:
                rings = self._by_turn[key] = {k: SampleRing(self.capacity) for k in TURN_KINDS}
            rings[kind].add(value, flag)
        self.version += 1

    def add_decode_rate(self, tokens_per_s: float) -> None:
        if not (tokens_per_s > 0.0) or not np.isfinite(tokens_per_s):
            return
        self.limits.decode_rate(tokens_per_s)
        if self.decode_rate_tokens_per_s <= 0.0:
            self.decode_rate_tokens_per_s = tokens_per_s
        else:
            a = self.rate_alpha
            self.decode_rate_tokens_per_s = (1 - a) * self.decode_rate_tokens_per_s + a * tokens_per_s

    def count(self, task: str, kind: str) -> int:
        rings = self._rings.get(task)
        return len(rings[kind]) if rings else 0

    def freeze(self) -> DistributionsView:
        tasks = {task: _samples(rings) for task, rings in self._rings.items()}
        by_turn = {key: _samples(rings) for key, rings in self._by_turn.items()}
        return DistributionsView(tasks, self.decode_rate_tokens_per_s, self.version, by_turn)


def _samples(rings: dict[str, SampleRing]) -> TaskSamples:
    """Copies of the rings' values (kinds without a ring are empty)."""
    empty = np.zeros(0)

    def values(kind: str) -> np.ndarray:
        ring = rings.get(kind)
        return ring.values() if ring is not None else empty

    gap = rings["gap_s"]
    filling = frozenset(k for k, ring in rings.items() if ring.count < len(ring._values))
    return TaskSamples(
        filling=filling,
        gap_s=gap.values(),
        gap_is_turn=gap.flags(),
        queue_wait_s=values("queue_wait_s"),
        prefill_wait_s=values("prefill_wait_s"),
        output_tokens=values("output_tokens"),
        new_tokens=values("new_tokens"),
        turns=values("turns"),
    )

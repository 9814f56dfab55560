"""The driver's knowledge of upcoming first turns, handed to the forecaster as `PendingArrival` hints.

A rollout driver knows the trajectories of a step once it submits the step, and their arrival offsets
(`TrajectorySpec.arrival_s`: 0 for the SWE trace, the trace's arrival process for Mooncake and Azure). What it
knows, by mode:
  none      nothing is passed (the forecaster learns only from what already happened);
  started   (default) the first turns of steps already submitted that have not arrived yet, at their exact times;
  schedule  also, in sync mode, the next step's first turns at (end of the current batch + `training_s`): the
            trainer's time per batch, which the simulator holds fixed, so this is the optimistic case of a driver
            that knows how long training takes. In async mode the next step is submitted the moment a batch
            ends, so nothing more is known ahead.
The step's submission time is read from the first trajectory of the step to start (its start minus its offset):
the simulator emits nothing when a step is submitted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from prorsa.sim.driver import StepSource
from prorsa.workload.types import TrajectorySpec
from services.forecaster.picture import PendingArrival

HINT_MODES: tuple[str, ...] = ("none", "started", "schedule")


class RecordingWorkload:
    """A `StepSource` that hands the driver the wrapped workload's steps and keeps them (steps are pure functions
    of their index, so asking for a step ahead of the driver changes nothing)."""

    def __init__(self, inner: StepSource) -> None:
        self.inner = inner
        self.name = inner.name
        self._steps: dict[int, list[TrajectorySpec]] = {}

    def step(self, index: int) -> list[TrajectorySpec]:
        specs = self._steps.get(index)
        if specs is None:
            specs = self._steps[index] = list(self.inner.step(index))
        return specs


@dataclass
class _Step:
    specs: dict[str, TrajectorySpec]
    start_s: float | None = None
    started: set[str] = field(default_factory=set)
    finished: int = 0


class ArrivalSchedule:
    """Pending first turns per the module header. Feed it `started`/`finished` events; ask `pending(now)`."""

    def __init__(
        self,
        workload: RecordingWorkload,
        mode: str = "started",
        sync: bool = True,
        training_s: float = 0.0,
        steps: int | None = None,
    ) -> None:
        if mode not in HINT_MODES:
            raise ValueError(f"hints must be one of {HINT_MODES}, got {mode!r}")
        self.workload = workload
        self.mode = mode
        self.sync = sync
        self.training_s = training_s
        self.steps = steps
        self._steps: dict[int, _Step] = {}
        self._expected_next: tuple[int, float] | None = None  # (step, expected submission time)

    def _step(self, index: int) -> _Step:
        s = self._steps.get(index)
        if s is None:
            s = self._steps[index] = _Step({t.traj_id: t for t in self.workload.step(index)})
        return s

    def started(self, step: int, traj_id: str, attempt: int, now: float) -> None:
        """A trajectory's turn 0 was submitted at `now`."""
        if self.mode == "none":
            return
        s = self._step(step)
        spec = s.specs.get(traj_id)
        if s.start_s is None and spec is not None and attempt == 0:
            s.start_s = now - spec.arrival_s
            if self._expected_next is not None and self._expected_next[0] == step:
                self._expected_next = None
        s.started.add(traj_id)

    def finished(self, step: int, now: float) -> None:
        """A trajectory of `step` finished at `now` (aborted attempts restart, so they do not count)."""
        if self.mode != "schedule" or not self.sync:
            return
        s = self._step(step)
        s.finished += 1
        last = self.steps is not None and step + 1 >= self.steps
        if s.finished == len(s.specs) and not last:
            self._expected_next = (step + 1, now + self.training_s)

    def pending(self, now: float) -> tuple[PendingArrival, ...]:
        """First turns not submitted by `now` that the driver knows of (see the module header)."""
        if self.mode == "none":
            return ()
        out = []
        for s in self._steps.values():
            if s.start_s is not None and len(s.started) < len(s.specs):
                out += _arrivals(s, s.start_s, now)
        if self._expected_next is not None:
            index, at_s = self._expected_next
            out += _arrivals(self._step(index), at_s, now)
        return tuple(out)


def _arrivals(s: _Step, start_s: float, now: float) -> list[PendingArrival]:
    specs = sorted((t for t in s.specs.values() if t.traj_id not in s.started), key=lambda t: t.arrival_s)
    offsets = [t.arrival_s for t in specs]
    # A spec whose time has come is about to be submitted (same virtual instant): still pending.
    first = bisect.bisect_left(offsets, now - start_s - 1e-9)
    return [
        PendingArrival(
            at_s=max(start_s + t.arrival_s, now), prompt_tokens=t.turns[0].new_prompt_tokens, task=t.task
        )
        for t in specs[first:]
    ]

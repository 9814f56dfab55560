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

from dataclasses import dataclass

from prorsa.sim.sim_driver import StepSource
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
    start_s: float | None = None  # submission time, once its first trajectory started
    finished: int = 0


class ArrivalSchedule:
    """Pending first turns per the module header. Feed it `started`/`finished` events; ask `pending(now)`.

    Events may be fed ahead of `now` (the evaluation releases ticks later than the simulator's clock): what a step
    reveals counts only from the time it was revealed, so `pending(now)` never knows of a step submitted after
    `now`, nor of a batch that ended after `now`."""

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
        # step -> (expected submission time, time that became known): a sync batch ended
        self._expected: dict[int, tuple[float, float]] = {}

    def _step(self, index: int) -> _Step:
        s = self._steps.get(index)
        if s is None:
            s = self._steps[index] = _Step({t.traj_id: t for t in self.workload.step(index)})
        return s

    def started(self, step: int, traj_id: str, attempt: int, now: float) -> None:
        """A trajectory's turn 0 was submitted at `now`."""
        s = self._step(step)
        spec = s.specs.get(traj_id)
        if s.start_s is None and spec is not None and attempt == 0:
            s.start_s = now - spec.arrival_s

    def finished(self, step: int, now: float) -> None:
        """A trajectory of `step` finished at `now` (aborted attempts restart, so they do not count)."""
        if self.mode != "schedule" or not self.sync:
            return
        s = self._step(step)
        s.finished += 1
        last = self.steps is not None and step + 1 >= self.steps
        if s.finished == len(s.specs) and not last:
            self._expected[step + 1] = (now + self.training_s, now)

    def pending(self, now: float) -> tuple[PendingArrival, ...]:
        """First turns after `now` that the driver knows of at `now` (see the module header)."""
        if self.mode == "none":
            return ()
        out = []
        for index, s in self._steps.items():
            if s.start_s is not None and s.start_s <= now:
                out += _arrivals(s, s.start_s, now)
            elif index in self._expected and self._expected[index][1] <= now:
                out += _arrivals(s, self._expected[index][0], now)
        for index, (at_s, known_s) in self._expected.items():
            if index not in self._steps and known_s <= now:
                out += _arrivals(self._step(index), at_s, now)
        return tuple(out)


def _arrivals(s: _Step, start_s: float, now: float) -> list[PendingArrival]:
    """The step's first turns still to come after `now` (arrival times are start + offset, exactly)."""
    return [
        PendingArrival(at_s=start_s + t.arrival_s, prompt_tokens=t.turns[0].new_prompt_tokens, task=t.task)
        for t in sorted(s.specs.values(), key=lambda t: t.arrival_s)
        if start_s + t.arrival_s > now
    ]

"""StepLearner: when the next RL step's first prompts arrive, learnt online from the run's own lifecycle. Pure.

Structural knowledge used: a rollout runs in steps, each rolled out with one policy version
(`TrajectoryStarted.policy_version`); in synchronous RL the trainer trains once a step's last trajectory ended,
then the driver submits the next step, whose first prompts arrive together (or along the step's arrival
process). No series model can see that burst coming: the demand series is flat zero while the trainer trains.
What is learnt, from events only (exact times, idempotent):
  drain      the time the last live trajectory of the run ended (no trajectory live since);
  gap_s      for each new step (a TrajectoryStarted with a policy version above every one seen), the time from
             the drain before it to its first trajectory's start; only when it started after a drain (in async
             RL the next step starts while the last one still runs: no idle gap, nothing to learn or predict);
  profile    each step's first turns: (seconds after the step's first start, prompt tokens, task) of every
             turn-0 submission of that step's trajectories (a GRPO group's samples share one first prompt, so
             they show up here as equal prompts at equal offsets).
`expected(now)`: while the run is drained, the next step as scenarios — one per learnt gap longer than the idle
time so far (each equally likely: the empirical conditional distribution), each the latest complete step's
profile shifted to drain + gap. Prior: none. Before one step boundary was seen nothing is predicted (the first
step of a run, or a run that is not in steps, gets no such term); once seen, the trainer's own timing is used.
Trajectory ids seen finish are remembered (bounded), so a duplicate or late TrajectoryStarted of an ended
trajectory is not taken for a live one.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

# (seconds after the step's first start, first-prompt tokens, task)
Arrival = tuple[float, float, str]


@dataclass(frozen=True)
class Scenario:
    """One way the next step may come: its first turns at `start_s + offset`, with probability `weight`."""

    weight: float
    start_s: float
    arrivals: tuple[Arrival, ...]


class StepLearner:
    def __init__(self, max_gaps: int = 16, max_finished: int = 200_000) -> None:
        self.gaps_s: deque[float] = deque(maxlen=max_gaps)
        self.drain_s: float | None = None  # when the run last became drained (None: something is live)
        self.max_version = -1
        self._live: dict[str, int] = {}  # live traj id -> policy version
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._max_finished = max_finished
        self._step_start: dict[int, float] = {}  # policy version -> its first start
        self._profiles: dict[int, list[Arrival]] = {}  # policy version -> its first turns so far
        self.latest_profile: tuple[Arrival, ...] = ()  # the newest step whose first turns all arrived
        self._latest_version = -1

    # --- input ------------------------------------------------------------------------------------------------
    def started(self, traj_id: str, version: int, now: float) -> None:
        if traj_id in self._live or traj_id in self._finished or not math.isfinite(now):
            return  # duplicate, or late news of an ended trajectory
        if version > self.max_version:
            if self.drain_s is not None and self.max_version >= 0 and now >= self.drain_s:
                self.gaps_s.append(now - self.drain_s)
            self.max_version = version
            self._step_start[version] = now
            self._profiles[version] = []
            self._forget_old_versions()
        self._live[traj_id] = version
        self.drain_s = None

    def first_turn(self, traj_id: str, prompt_tokens: float, task: str, now: float) -> None:
        version = self._live.get(traj_id)
        start = self._step_start.get(version) if version is not None else None
        if start is None or not (prompt_tokens >= 0.0) or not math.isfinite(prompt_tokens):
            return
        self._profiles[version].append((max(0.0, now - start), float(prompt_tokens), task))

    def finished(self, traj_id: str, now: float) -> None:
        version = self._live.pop(traj_id, None)
        if version is None:
            return
        self._finished[traj_id] = None
        if len(self._finished) > self._max_finished:
            self._finished.popitem(last=False)
        if not self._live and math.isfinite(now):
            self.drain_s = now
            # every trajectory of every step has ended: the newest step's first turns are all in
            newest = max(self._profiles, default=-1)
            if newest >= 0 and self._profiles[newest]:
                self.latest_profile = tuple(sorted(self._profiles[newest]))
                self._latest_version = newest

    def _forget_old_versions(self) -> None:
        for v in [v for v in self._profiles if v < self.max_version - 2]:
            del self._profiles[v]
            self._step_start.pop(v, None)

    # --- output -----------------------------------------------------------------------------------------------
    @property
    def live(self) -> int:
        return len(self._live)

    def expected(self, now: float) -> list[Scenario]:
        """The next step's scenarios while drained (module header); [] when nothing is known."""
        if self.drain_s is None or not self.gaps_s or not self.latest_profile:
            return []
        idle = now - self.drain_s
        ahead = [g for g in self.gaps_s if g > idle]
        if not ahead:
            return []  # later than every step before: the run may be over
        w = 1.0 / len(ahead)
        return [Scenario(w, self.drain_s + g, self.latest_profile) for g in ahead]

"""A workload made of hand-built trajectories, replayed at every RL step (tests, what-if scenarios)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from prorsa.workload.types import TrajectorySpec


class FixedWorkload:
    """Every step holds the same trajectories; ids and groups get the step as a prefix (`s{i}-...`)."""

    def __init__(self, specs: Sequence[TrajectorySpec], name: str = "fixed") -> None:
        if not specs:
            raise ValueError("a fixed workload needs at least one trajectory")
        self.name = name
        self.notes = [f"{len(specs)} fixed trajectories per step"]
        self._specs = tuple(specs)

    def step(self, index: int) -> list[TrajectorySpec]:
        return [
            replace(s, traj_id=f"s{index}-{s.traj_id}", group=f"s{index}-{s.group}" if s.group else "")
            for s in self._specs
        ]

"""Live state of the simulation: trajectories being rolled out and the requests (turns) they have in flight.

Only live objects are kept: a trajectory is dropped once finished (its completion time goes to the metrics'
streaming aggregates), so memory grows with concurrency, not with history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mypy_extensions import mypyc_attr

from prorsa.workload.types import TrajectorySpec
from services.engine_agent.engine_core import CoreSeq

if TYPE_CHECKING:
    from prorsa.sim.engine import SimEngine


@mypyc_attr(allow_interpreted_subclasses=True)  # deep-copied by `Simulation.fork` (see `prorsa.native`)
@dataclass(slots=True, eq=False)
class Traj:
    """One attempt at rolling out a trajectory spec (an aborted trajectory restarts as a new attempt)."""

    spec: TrajectorySpec
    step: int  # RL step it belongs to
    attempt: int  # 0, then 1, 2, ... after aborts
    version: int  # policy version it was started under
    key: str  # prefix-cache key: unique per step and attempt
    group_key: str  # prefix-cache key of its GRPO group's shared first prompt ("" if none)
    group_tokens: int  # tokens of turn 0 shared by the group (0 without a group)
    turn: int = 0  # index of the turn in flight or next to submit
    context_tokens: int = 0  # prompt length of turn `turn` (whole history)
    start_s: float = -1.0  # submission time of turn 0 (-1: not started)
    decoded_tokens: int = 0  # tokens of finished turns + partials of migrated decodes (wasted if aborted)
    alive: bool = True  # False once finished or aborted
    request: Request | None = None  # the turn currently inside the engines (None during tool calls)
    last_engine: SimEngine | None = None  # engine that last prefilled it (prefix affinity)


@mypyc_attr(allow_interpreted_subclasses=True)  # deep-copied by `Simulation.fork` (see `prorsa.native`)
class Request(CoreSeq):
    """One turn's work inside the engines (an engine core's sequence, with the trajectory it belongs to).

    A migrated request (its decode engine switched role) carries the tokens decoded so far in its context, is
    prefilled again elsewhere (counted as recomputation) and decodes the rest.
    """

    __slots__ = ("traj", "turn")

    def __init__(
        self, rid: int, traj: Traj, turn: int, context_tokens: int, output_tokens: int, migrated: bool = False
    ) -> None:
        CoreSeq.__init__(
            self,
            rid,
            traj.key,
            context_tokens,
            output_tokens,
            group_key=traj.group_key,
            group_tokens=traj.group_tokens,
            migrated=migrated,
        )
        self.traj = traj
        self.turn = turn

    def __repr__(self) -> str:
        return f"Request({self.traj.spec.traj_id}#{self.turn}, ctx={self.context_tokens}, out={self.output_tokens})"

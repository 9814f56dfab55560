"""When a trajectory is too stale to go on: the one rule both RL drivers apply (the simulator's
`prorsa.sim.sim_driver` and the live `prorsa.rollout.live_driver`).

Bounded staleness k (async mode): a trajectory started under policy version v may be trained on while the
trainer's weights are at most k versions newer. Once they move further, what it would still generate is wasted,
so it restarts from turn 0 under the new weights. Restart rather than resume, because resuming would mix tokens of
two policies in one trajectory, which bounded-staleness trainers exclude.

When: at the submission of each turn. That is where the live system can stop a trajectory — a turn in flight has
no abort on the bus, its engine finishes it — so the simulator stops it there too, and the two measure the same
waste (the rest of the turn in flight at the weights update).
"""

from __future__ import annotations


def must_restart(mode: str, staleness: int, version_now: int, version_started: int) -> bool:
    """Whether a trajectory started under `version_started` must restart before its next turn."""
    return mode == "async" and version_now - version_started > staleness

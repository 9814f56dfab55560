"""Workloads for Prorsa: real traces (SWE agent, Mooncake, Azure), task profiles, and the spec that names them.

from prorsa.workload import load_workload, describe
workload = load_workload("mix:swe+profile:math", batch_size=64, group_size=8, seed=0)
batch = workload.step(0)          # list[TrajectorySpec], deterministic for (spec, sizes, seed, index)
"""

from prorsa.workload.errors import WorkloadError
from prorsa.workload.spec import VALID_FORMS, Workload, load_workload
from prorsa.workload.summary import describe, describe_trajectories
from prorsa.workload.types import TrajectorySpec, Turn

__all__ = [
    "VALID_FORMS",
    "TrajectorySpec",
    "Turn",
    "Workload",
    "WorkloadError",
    "describe",
    "describe_trajectories",
    "load_workload",
]

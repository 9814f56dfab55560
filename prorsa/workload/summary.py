"""Summary statistics of a workload's trajectories, for docs, notes and tests."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from prorsa.workload.spec import Workload
from prorsa.workload.types import TrajectorySpec


def describe(workload: Workload, *, steps: int = 1) -> dict[str, float]:
    """Statistics over the trajectories of steps 0..steps-1 (see `describe_trajectories` for the keys)."""
    return describe_trajectories(traj for index in range(steps) for traj in workload.step(index))


def describe_trajectories(trajectories: Iterable[TrajectorySpec]) -> dict[str, float]:
    """Percentiles of a set of trajectories.

    Keys: `trajectories`, `turns` (total), `turns_p50`, `turns_p99` (per trajectory); `new_prompt_tokens_p50/p99`
    and `output_tokens_p50/p99` (per turn); `tool_calls` and `tool_latency_s_p50/p99` (per turn that is followed by
    a tool call, i.e. all but each trajectory's last; 0.0 when there are none); `prefill_decode_ratio` (total new
    prompt tokens / total output tokens: the new-prefill : decode token mix); `arrival_span_s` (last - first
    arrival). Raises ValueError for an empty set.
    """
    trajs = list(trajectories)
    if not trajs:
        raise ValueError("describe_trajectories needs at least one trajectory")
    turns_per = np.array([len(t.turns) for t in trajs])
    new = np.array([u.new_prompt_tokens for t in trajs for u in t.turns], dtype=float)
    out = np.array([u.output_tokens for t in trajs for u in t.turns], dtype=float)
    latency = np.array([u.tool_latency_s for t in trajs for u in t.turns[:-1]], dtype=float)
    arrivals = [t.arrival_s for t in trajs]
    lat_p50, lat_p99 = np.percentile(latency, [50, 99]) if latency.size else (0.0, 0.0)
    return {
        "trajectories": float(len(trajs)),
        "turns": float(turns_per.sum()),
        "turns_p50": float(np.percentile(turns_per, 50)),
        "turns_p99": float(np.percentile(turns_per, 99)),
        "new_prompt_tokens_p50": float(np.percentile(new, 50)),
        "new_prompt_tokens_p99": float(np.percentile(new, 99)),
        "output_tokens_p50": float(np.percentile(out, 50)),
        "output_tokens_p99": float(np.percentile(out, 99)),
        "tool_calls": float(latency.size),
        "tool_latency_s_p50": float(lat_p50),
        "tool_latency_s_p99": float(lat_p99),
        "prefill_decode_ratio": float(new.sum() / out.sum()),
        "arrival_span_s": float(max(arrivals) - min(arrivals)),
    }

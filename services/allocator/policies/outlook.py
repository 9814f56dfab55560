"""The forecast's demand outlook as a policy reads it: every task together (`Outlook`, `outlook_of`). Pure.

Demand reaches a policy one way: the forecaster's `DemandForecast` (`proto.TaskOutlook` per task), built from the
tracker's snapshots and the lifecycle events — the tracker's snapshot is the forecaster's input, never the
allocator's. What a policy needs of it, summed or averaged over the tasks:
  live, live_by_task     trajectories live now (all phases), in all and per task (the task mix);
  started_total          the tracker's count of trajectories started, at the forecast's snapshot (a step start);
  finishing_per_s        trajectories finishing per second over the outlook's horizon (the mean);
  per turn ahead         new tokens, output tokens, context at prefill, tool seconds: each task's mean weighted by
                         the turns it submits over the horizon (by its live trajectories where none are expected),
                         over the tasks whose figure rests on observations; None where none does (a prior, or
                         nothing seen yet: the policy keeps its own default).
No outlook (`outlook_of` is None): no forecast yet, a stale one (the service drops it), or an older forecaster
that sends none (`outlook_horizon_s` 0). The policy then falls back (prorsa.py says how).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from proto import DemandForecast, TaskOutlook
from services.allocator.policy import ClusterView, PolicyError

TURN_FIGURES = ("new_tokens", "output_tokens", "context_tokens", "tool_s")


@dataclass(frozen=True, slots=True)
class Outlook:
    """The outlook of one forecast, all tasks together (module header)."""

    live: int
    live_by_task: dict[str, int]
    started_total: int
    horizon_s: float
    finishing_per_s: float
    new_tokens: float | None = None
    output_tokens: float | None = None
    context_tokens: float | None = None
    tool_s: float | None = None


def _per_turn(tasks: Sequence[TaskOutlook], name: str) -> float | None:
    seen = [t for t in tasks if getattr(t, name).observed > 0]
    if not seen:
        return None
    weights = [t.turns.mean for t in seen]
    if not sum(weights) > 0:
        weights = [float(t.live) for t in seen]
    if not sum(weights) > 0:
        weights = [1.0] * len(seen)
    return sum(w * getattr(t, name).mean for w, t in zip(weights, seen, strict=True)) / sum(weights)


def outlook_of(view: ClusterView) -> Outlook | None:
    """The view's forecast's outlook, all tasks together; None without one (module header). Raises PolicyError on
    figures no forecaster can have made (the wire refuses them on decode; an in-process forecaster could still)."""
    forecast = view.forecast
    if not isinstance(forecast, DemandForecast) or not forecast.outlook_horizon_s > 0:
        return None
    horizon = forecast.outlook_horizon_s
    tasks = forecast.outlook
    figures = {name: _per_turn(tasks, name) for name in TURN_FIGURES}
    finishing = sum(t.finished.mean for t in tasks) / horizon
    for name, v in (*figures.items(), ("finishing_per_s", finishing), ("outlook_horizon_s", horizon)):
        if v is not None and not (math.isfinite(v) and v >= 0.0):
            raise PolicyError(f"forecast outlook: {name} is {v}")
    return Outlook(
        live=sum(t.live for t in tasks),
        live_by_task={t.task: t.live for t in tasks},
        started_total=forecast.started_total,
        horizon_s=horizon,
        finishing_per_s=finishing,
        **figures,
    )

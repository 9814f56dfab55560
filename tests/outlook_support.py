"""Forecasts that carry only a demand outlook, for policy tests: the live trajectories per task and their turns."""

from __future__ import annotations

from proto import DemandForecast, Estimate, TaskOutlook
from services.allocator.policies.turn_model import TurnShape


def exact(v: float, observed: int = 10) -> Estimate:
    """A figure known exactly (q10 = q50 = q90 = mean), resting on `observed` observations."""
    return Estimate(mean=v, q10=v, q50=v, q90=v, observed=observed)


def outlook_forecast(
    live_by_task: dict[str, int],
    shape: TurnShape | None = None,
    started_total: int = 0,
    in_tool: int = 0,
    now: float = 0.0,
    finished_per_s: float = 0.0,
    turns_per_s: float = 0.0,
) -> DemandForecast:
    """A forecast with no horizons (so no risk scenarios: forecast_of is None) and an outlook over 5 s: per task
    its live trajectories (`in_tool` of each in a tool call, the rest decoding), turns of `shape` (None: no figure
    observed), and `finished_per_s` / `turns_per_s` of each task."""
    horizon = 5.0
    figures: dict[str, Estimate] = {}
    if shape is not None:
        figures = {
            "new_tokens": exact(shape.new_tokens),
            "output_tokens": exact(shape.output_tokens),
            "context_tokens": exact(shape.context_tokens),
            "tool_s": exact(shape.tool_s),
        }
    tasks = [
        TaskOutlook(
            task=task,
            decode=n - min(in_tool, n),
            tool_call=min(in_tool, n),
            turns=exact(turns_per_s * horizon, n),
            finished=exact(finished_per_s * horizon, n),
            **figures,
        )
        for task, n in live_by_task.items()
        if n > 0
    ]
    return DemandForecast(
        ts_s=now,
        predictor="test",
        horizons=[],
        outlook=tasks,
        outlook_horizon_s=horizon,
        started_total=started_total,
    )

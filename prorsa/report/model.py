"""What one run contributes to the HTML report, whatever produced it (the simulator or the live system).

Every time is in workload seconds from the start of the run; every rate in tokens per second. The sources
(`prorsa.report.sources`) fill these from the JSON and recordings the commands already produce; the figures
(`prorsa.report.figures`) and the page (`prorsa.report.page`) read nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLE_COLOURS = {"prefill": "#1f77b4", "decode": "#ff7f0e", "mixed": "#2ca02c", "switching": "#9e9e9e"}


@dataclass(frozen=True)
class Windows:
    """Demand against capacity, one value per window [t_s[i], t_s[i] + window_s)."""

    window_s: float
    t_s: list[float]
    prefill_demand: list[float]  # new prompt tokens of the turns submitted in the window, per second
    prefill_computed: list[float]  # prompt tokens the engines computed, per second
    decode: list[float]  # output tokens generated, per second
    # Capacity of the engines in each role (None: unknown, e.g. a real engine without a profile).
    prefill_capacity: list[float] | None = None
    decode_capacity: list[float] | None = None
    mixed_prefill_capacity: list[float] | None = None
    mixed_decode_capacity: list[float] | None = None

    def mean_rate(self, series: list[float], start_s: float, horizon_s: float) -> float | None:
        """Overlap-weighted mean of `series` over (start_s, start_s + horizon_s]; None outside the windows."""
        end = start_s + horizon_s
        if not self.t_s or horizon_s <= 0 or end > self.t_s[-1] + self.window_s + 1e-9:
            return None
        total = 0.0
        for t, v in zip(self.t_s, series, strict=True):
            overlap = min(end, t + self.window_s) - max(start_s, t)
            if overlap > 0:
                total += v * overlap
        return total / horizon_s


@dataclass(frozen=True)
class Forecasts:
    """The forecasts a policy read, at their first horizon, as rates over the next `horizon_s`."""

    t_s: list[float]
    horizon_s: list[float]
    prefill: tuple[list[float], list[float], list[float]]  # q10, q50, q90 (tokens/s)
    decode: tuple[list[float], list[float], list[float]]


def band_coverage(f: Forecasts, w: Windows) -> dict[str, tuple[float, int]]:
    """role -> (share of forecasts whose realised rate over their horizon fell within q10..q90, forecasts scored):
    what a reader needs to trust a band (nominal 80 %), for the forecasts whose horizon the windows cover."""
    out: dict[str, tuple[float, int]] = {}
    for role, (q10, _, q90), series in (
        ("prefill", f.prefill, w.prefill_demand),
        ("decode", f.decode, w.decode),
    ):
        inside = scored = 0
        for i, (t, h) in enumerate(zip(f.t_s, f.horizon_s, strict=True)):
            r = w.mean_rate(series, t, h)
            if r is None:
                continue
            scored += 1
            # a relative slack: the band and the realised rate come from two roundings of the same tokens
            slack = 1e-9 * max(abs(r), 1.0)
            inside += q10[i] - slack <= r <= q90[i] + slack
        if scored:
            out[role] = (inside / scored, scored)
    return out


@dataclass(frozen=True)
class RunData:
    name: str  # column and section title, e.g. "prorsa" or "sim colocated"
    summary: dict[str, Any]  # the comparison table's figures (keys of prorsa.rollout.report.SUMMARY_ROWS)
    end_s: float = 0.0
    roles: dict[str, list[tuple[float, str]]] = field(
        default_factory=dict
    )  # engine → [(t_s, role)] at changes
    windows: Windows | None = None
    forecasts: Forecasts | None = None
    # Completed trajectories' times as (seconds, count): exact values from a live run, 1 % buckets from the sim.
    trajectory_s: list[tuple[float, int]] = field(default_factory=list)
    error: str = (
        ""  # the run could not happen (a bench policy that does not fit the fleet): only this is shown
    )
    forecast_note: str = ""  # why there is no forecast plot

    @property
    def completed(self) -> int:
        return sum(n for _, n in self.trajectory_s)

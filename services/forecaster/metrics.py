"""The forecaster's domain metrics: demand forecast against realised demand, per role.

prorsa_demand_forecast_tokens_per_second{role, horizon_seconds, quantile}
      the newest forecast of each horizon as a rate: tokens forecast over the next `horizon_seconds`, divided by
      it (role prefill: new prompt tokens arriving; decode: output tokens generated); quantile 0.1, 0.5, 0.9
prorsa_demand_tokens_total{role}
      the demand that happened, by the same definitions (the forecaster's closed series windows,
      `services.forecaster.series`): `rate()` of it over a horizon is what the forecast made then predicted
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from proto import DemandForecast
from services.forecaster.series import SeriesPoint
from services.runtime.metrics import ServiceMetrics

ROLES = ("prefill", "decode")
QUANTILES = (("0.1", "q10"), ("0.5", "q50"), ("0.9", "q90"))


class ForecastMetrics:
    def __init__(self, m: ServiceMetrics, horizons_s: Sequence[float]) -> None:
        forecast = m.gauge(
            "prorsa_demand_forecast_tokens_per_second",
            "Demand forecast over the next horizon, as tokens per second",
            ["role", "horizon_seconds", "quantile"],
        )
        realised = m.counter("prorsa_demand_tokens", "Demand that happened, in tokens", ["role"])
        self._forecast = {
            (role, float(h), q): forecast.labels(role=role, horizon_seconds=f"{h:g}", quantile=q)
            for role in ROLES
            for h in horizons_s
            for q, _ in QUANTILES
        }
        self._realised = {role: realised.labels(role=role) for role in ROLES}
        self._seen_end_s = -math.inf

    def observe_forecast(self, f: DemandForecast) -> None:
        for h in f.horizons:
            if h.horizon_s <= 0:
                continue
            for role, quantiles in (("prefill", h.prefill_tokens), ("decode", h.decode_tokens)):
                for q, attr in QUANTILES:
                    gauge = self._forecast.get((role, float(h.horizon_s), q))
                    if gauge is not None:
                        gauge.set(getattr(quantiles, attr) / h.horizon_s)

    def observe_series(self, points: Sequence[SeriesPoint]) -> None:
        """The series' closed windows in time order; those counted before are skipped (read from the newest back,
        so a call costs the new windows only)."""
        new = []
        for p in reversed(points):
            if p.end_s <= self._seen_end_s:
                break
            new.append(p)
        for p in reversed(new):
            self._realised["prefill"].inc(p.prefill_tokens)
            self._realised["decode"].inc(p.decode_tokens)
            self._seen_end_s = p.end_s

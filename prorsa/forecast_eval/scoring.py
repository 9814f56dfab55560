"""Scores of quantile forecasts against what happened.

  WAPE          sum |q50 - actual| / sum |actual| over the scored forecasts (0 = perfect; 1 = as bad as
                forecasting 0 everywhere). NaN when nothing happened at all.
  coverage90    fraction of actuals <= q90: the one-sided 90 % bound (nominal 0.90).
  coverage80    fraction of actuals within [q10, q90]: the central 80 % interval (nominal 0.80).
A forecast is scored only when its horizon ends within the run (`valid`).
"""

from __future__ import annotations

import math

import numpy as np

# Relative slack when comparing an actual to a quantile (a perfect forecast computed through another path may
# differ in the last bits).
_TOL = 1e-9


def wape(q50: np.ndarray, actual: np.ndarray) -> float:
    den = float(np.abs(actual).sum())
    return float(np.abs(q50 - actual).sum()) / den if den > 0 else math.nan


def coverage_below(q90: np.ndarray, actual: np.ndarray) -> float:
    if not actual.size:
        return math.nan
    return float(np.mean(actual <= q90 + _TOL * np.maximum(np.abs(q90), 1.0)))


def coverage_within(q10: np.ndarray, q90: np.ndarray, actual: np.ndarray) -> float:
    if not actual.size:
        return math.nan
    slack = _TOL * np.maximum(np.abs(actual), 1.0)
    return float(np.mean((actual >= q10 - slack) & (actual <= q90 + slack)))


def score(
    forecast: np.ndarray, actual: np.ndarray, valid: np.ndarray, metrics: tuple[str, ...]
) -> list[dict[str, float]]:
    """Per horizon j: WAPE and coverages per metric, and pooled coverages.

    forecast: (ticks, horizons, metrics, 3) with q10, q50, q90; actual: (ticks, horizons, metrics);
    valid: (ticks, horizons) booleans."""
    out = []
    for j in range(actual.shape[1]):
        ok = valid[:, j]
        row: dict[str, float] = {"forecasts": int(ok.sum())}
        below, within = [], []
        for i, m in enumerate(metrics):
            name = m.removesuffix("_tokens")
            f, a = forecast[ok, j, i], actual[ok, j, i]
            row[f"{name}_wape"] = wape(f[:, 1], a)
            row[f"{name}_coverage90"] = coverage_below(f[:, 2], a)
            row[f"{name}_coverage80"] = coverage_within(f[:, 0], f[:, 2], a)
            below.append(row[f"{name}_coverage90"])
            within.append(row[f"{name}_coverage80"])
        row["coverage90"] = float(np.mean(below))
        row["coverage80"] = float(np.mean(within))
        out.append(row)
    return out

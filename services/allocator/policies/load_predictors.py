"""Load predictors for the `dynamo` policy: add one observation per adjustment interval, predict the next.

After ai-dynamo/dynamo components/planner/src/dynamo/planner/utils/load_predictor.py (a small base class that cleans
input once, `constant` / `arima` / `prophet` behind a name → class table). Own code; differences, on purpose:
* `arima` is statsmodels' ARIMA(1,1,0) fitted by Burg's method on the last `window` points, not pmdarima's
  auto_arima: one small, fixed model fits in milliseconds, so the planner can refit every slow interval (Dynamo's
  auto-ARIMA order search costs seconds). Until `min_points` observations it predicts the last value, as Dynamo does;
  a fit that fails or predicts nonsense (NaN, inf) also falls back to the last value.
* no `prophet` (a heavy dependency for a baseline that works on minutes of history).
Predictions are clamped at 0: a load is never negative.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ConstantPredictor:
    """Predicts the last value (Dynamo's `constant`)."""

    window: int = 20
    min_points: int = 1
    history: deque[float] = field(default_factory=deque)

    def add(self, value: float) -> None:
        """Record one observation; NaN or inf count as 0 (as Dynamo's base class does)."""
        self.history.append(value if math.isfinite(value) else 0.0)
        while len(self.history) > max(1, self.window):
            self.history.popleft()

    def last(self) -> float:
        return self.history[-1] if self.history else 0.0

    def predict_next(self) -> float:
        return max(0.0, self.last())


@dataclass
class ArimaPredictor(ConstantPredictor):
    """ARIMA(1,1,0) on the last `window` points; the last value until `min_points` are in."""

    min_points: int = 5
    order: tuple[int, int, int] = (1, 1, 0)
    fits: int = 0  # successful fits (cost accounting in tests and benchmarks)
    fallbacks: int = 0  # predictions that fell back to the last value after a failed fit

    def predict_next(self) -> float:
        if len(self.history) < self.min_points:
            return max(0.0, self.last())
        y = np.asarray(self.history, dtype=float)
        steps = np.diff(y)
        # Exactly linear (or constant): the fit would be singular; with d = 1 the forecast is the last step again.
        if np.ptp(steps) == 0.0:
            return max(0.0, float(y[-1] + steps[-1]))
        try:
            # Imported here: statsmodels takes seconds to import and only this predictor needs it.
            from statsmodels.tsa.arima.model import ARIMA

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = ARIMA(y, order=self.order).fit(method="burg")
                value = float(result.forecast(1)[0])
        except (ValueError, np.linalg.LinAlgError):
            self.fallbacks += 1
            return max(0.0, self.last())
        if not math.isfinite(value):
            self.fallbacks += 1
            return max(0.0, self.last())
        self.fits += 1
        return max(0.0, value)


LOAD_PREDICTORS: dict[str, type[ConstantPredictor]] = {"constant": ConstantPredictor, "arima": ArimaPredictor}

"""DemandLedger: the demand that really happened in a run, accounted exactly from the event stream.

Definitions are those of `services/forecaster/series.py`, evaluated in continuous time instead of on 1 s windows:
  prefill_tokens(t, h)  new prompt tokens of the turns submitted in (t, t+h] (a point mass at each submission);
  decode_tokens(t, h)   output tokens generated in (t, t+h]. The simulator reports decode progress only when an
                        engine's decode jump ends (every finish or admission), so the tokens between two reports of
                        one request are spread uniformly over the interval between them: exact up to the small drift
                        of step time within a jump (the context grows by one token per step).
A report with no time in between (same timestamp) is a point mass. Both are kept as cumulative functions C(x) =
tokens by time x, so demand over (t, t+h] is C(t+h) - C(t) for any t and h.
"""

from __future__ import annotations

import numpy as np


class DemandLedger:
    """Records prefill arrivals and decode intervals; `cumulative(metric, x)` evaluates C at times x."""

    def __init__(self) -> None:
        self._prefill_t: list[float] = []
        self._prefill_n: list[float] = []
        self._seg_t0: list[float] = []
        self._seg_t1: list[float] = []
        self._seg_n: list[float] = []
        self.prefill_total_tokens = 0.0
        self.decode_total_tokens = 0.0

    def add_prefill(self, t: float, tokens: float) -> None:
        """`tokens` new prompt tokens submitted at `t`."""
        if tokens > 0:
            self._prefill_t.append(t)
            self._prefill_n.append(float(tokens))
            self.prefill_total_tokens += tokens

    def add_decode(self, t0: float, t1: float, tokens: float) -> None:
        """`tokens` generated uniformly over (t0, t1] (a point mass at t1 when t1 <= t0)."""
        if tokens > 0:
            self._seg_t0.append(min(t0, t1))
            self._seg_t1.append(t1)
            self._seg_n.append(float(tokens))
            self.decode_total_tokens += tokens

    def cumulative(self, metric: str, x: np.ndarray) -> np.ndarray:
        """C(x): tokens of `metric` ("prefill_tokens" or "decode_tokens") by each time in `x` (inclusive)."""
        x = np.asarray(x, dtype=np.float64)
        if metric == "prefill_tokens":
            return _masses(np.array(self._prefill_t), np.array(self._prefill_n), x)
        if metric != "decode_tokens":
            raise ValueError(f"the ledger accounts prefill_tokens and decode_tokens, not {metric!r}")
        t0, t1, n = (np.array(v, dtype=np.float64) for v in (self._seg_t0, self._seg_t1, self._seg_n))
        point = t1 - t0 < 1e-9
        return _masses(t1[point], n[point], x) + _linear(t0[~point], t1[~point], n[~point], x)

    def realised(self, metric: str, starts_s: np.ndarray, horizon_s: float) -> np.ndarray:
        """Demand over (t, t + horizon_s] for each t in `starts_s`."""
        starts = np.asarray(starts_s, dtype=np.float64)
        return self.cumulative(metric, starts + horizon_s) - self.cumulative(metric, starts)


def _masses(t: np.ndarray, n: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Sum of the masses n at times t <= x."""
    if not len(t):
        return np.zeros_like(x)
    order = np.argsort(t, kind="stable")
    c = np.concatenate(([0.0], np.cumsum(n[order])))
    return c[np.searchsorted(t[order], x, side="right")]


def _linear(t0: np.ndarray, t1: np.ndarray, n: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Sum over intervals of n * clip((x - t0) / (t1 - t0), 0, 1): the integral of a piecewise-constant rate,
    exact and linear between the sorted interval ends, so it is evaluated by interpolation."""
    if not len(t0):
        return np.zeros_like(x)
    rate = n / (t1 - t0)
    times = np.concatenate((t0, t1))
    delta = np.concatenate((rate, -rate))
    order = np.argsort(times, kind="stable")
    times, delta = times[order], delta[order]
    rate_after = np.cumsum(delta)
    integral = np.concatenate(([0.0], np.cumsum(rate_after[:-1] * np.diff(times))))
    # Beyond the last end the integral is flat at the total (interp clamps at both ends).
    return np.interp(x, times, integral)

"""Demand as a windowed series, and what "demand over a horizon" means.

Definitions (the simulator's evaluation scores exactly these; `realised()` computes them from a series):
  prefill_tokens(t, h)     new prompt tokens of the turns submitted in (t, t+h]: the tokens an engine holding the
                           trajectory's prefix must still prefill (turn 0: the whole first prompt; later turns: the
                           tool observation and template tokens = `TurnSubmitted.new_tokens`). Arrivals, whatever
                           the prefill capacity.
  decode_tokens(t, h)      output tokens generated in (t, t+h]. Forecasts assume decode capacity is not the
                           bottleneck (each decoding sequence advances at the observed per-sequence rate); the
                           measured series is what was generated.
  decode_concurrency(t, h) time-average number of sequences decoding over (t, t+h].
  kv_tokens(t, h)          context tokens (prompt + generated) held by decoding sequences at t+h.

The series: time is cut into windows [k*W, (k+1)*W) on a fixed grid (W = `window_s`). Flows (prefill, decode
tokens) are summed into the window of the event's arrival time; levels (decode concurrency, KV tokens) are the
last value seen by the window's end (carried forward). `Windower` emits each window once it is closed (an input
at or after its end arrived). On the series, demand over (t, t+h] is the overlap-weighted sum of the windows it
covers (flows), their overlap-weighted mean (concurrency) and the level of the window holding t+h (KV).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

METRICS: tuple[str, ...] = ("prefill_tokens", "decode_tokens", "decode_concurrency", "kv_tokens")
FLOW_METRICS: tuple[str, ...] = ("prefill_tokens", "decode_tokens")
HORIZONS_S: tuple[float, ...] = (5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """One closed window [end_s - window_s, end_s)."""

    end_s: float
    window_s: float
    prefill_tokens: float  # new prompt tokens that arrived in the window
    decode_tokens: float  # output tokens generated in the window
    decode_concurrency: float  # sequences decoding at the window's end
    kv_tokens: float  # context tokens of the decoding sequences at the window's end

    def value(self, metric: str) -> float:
        return float(getattr(self, metric))


class Windower:
    """Cuts flows (by arrival time) and levels (carried forward) into closed `SeriesPoint`s on a fixed grid.

    An input older than the open window (a slightly late event, clocks of two sources) is counted in the open
    window. A jump of more than `max_gap_windows` empty windows restarts the grid instead of emitting them all.
    """

    def __init__(self, window_s: float = 1.0, max_gap_windows: int = 600) -> None:
        if not (window_s > 0.0):
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self.max_gap_windows = max_gap_windows
        self._index: int | None = None  # open window index
        self._prefill = 0.0
        self._decode = 0.0
        self._concurrency = 0.0
        self._kv = 0.0

    def _roll(self, now: float) -> list[SeriesPoint]:
        if not math.isfinite(now):
            return []
        k = math.floor(now / self.window_s)
        if self._index is None:
            self._index = k
            return []
        if k <= self._index:
            return []
        out = []
        if k - self._index > self.max_gap_windows:
            self._index = k - self.max_gap_windows
        while self._index < k:
            out.append(self._close())
        return out

    def _close(self) -> SeriesPoint:
        assert self._index is not None
        self._index += 1
        p = SeriesPoint(
            end_s=self._index * self.window_s,
            window_s=self.window_s,
            prefill_tokens=self._prefill,
            decode_tokens=self._decode,
            decode_concurrency=self._concurrency,
            kv_tokens=self._kv,
        )
        self._prefill = self._decode = 0.0
        return p

    def add_flow(
        self, now: float, prefill_tokens: float = 0.0, decode_tokens: float = 0.0
    ) -> list[SeriesPoint]:
        """Count tokens arriving at `now`; returns the windows this closed (before counting)."""
        closed = self._roll(now)
        self._prefill += max(0.0, prefill_tokens)
        self._decode += max(0.0, decode_tokens)
        return closed

    def set_levels(self, now: float, decode_concurrency: float, kv_tokens: float) -> list[SeriesPoint]:
        closed = self._roll(now)
        self._concurrency = max(0.0, decode_concurrency)
        self._kv = max(0.0, kv_tokens)
        return closed

    def advance(self, now: float) -> list[SeriesPoint]:
        return self._roll(now)


def _overlap(p: SeriesPoint, start: float, end: float) -> float:
    lo = max(p.end_s - p.window_s, start)
    hi = min(p.end_s, end)
    return max(0.0, hi - lo) / p.window_s


def realised(points: Sequence[SeriesPoint], start_s: float, horizon_s: float) -> dict[str, float] | None:
    """Demand over (start_s, start_s + horizon_s] per the module's definitions; None until the series covers it.

    `points` are consecutive closed windows in time order."""
    end = start_s + horizon_s
    if not points or points[-1].end_s < end - 1e-9 or points[0].end_s - points[0].window_s > start_s + 1e-9:
        return None
    flows = dict.fromkeys(FLOW_METRICS, 0.0)
    conc = 0.0
    weight = 0.0
    kv = 0.0
    for p in points:
        if p.end_s <= start_s:
            continue
        w = _overlap(p, start_s, end)
        if w > 0.0:
            flows["prefill_tokens"] += w * p.prefill_tokens
            flows["decode_tokens"] += w * p.decode_tokens
            conc += w * p.decode_concurrency
            weight += w
        if p.end_s - p.window_s < end <= p.end_s + 1e-9:
            kv = p.kv_tokens
        if p.end_s >= end:
            break
    return {**flows, "decode_concurrency": conc / weight if weight else 0.0, "kv_tokens": kv}

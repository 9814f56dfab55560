"""Token sums per time window: how an amount of work done over [t0, t1] lands in windows of a fixed width (pure).

The engine core counts its steps this way (`engine_core.StepTally`), the simulator its other series (`prorsa.sim.metrics`).
"""

from __future__ import annotations


def spread(row: list[float], window_s: float, t0: float, t1: float, amount: float) -> None:
    """Add `amount` to `row` (windows of `window_s`) spread uniformly over [t0, t1]; all at t0 if t1 <= t0.

    Called for every engine step, so the common case (the span inside one window) is a few operations.
    """
    if t1 <= t0:
        last = first = int(t0 / window_s)
    else:
        first, last = int(t0 / window_s), int(t1 / window_s)
    if len(row) <= last:
        row.extend([0.0] * (last + 1 - len(row)))
    if first == last:
        row[first] += amount
        return
    rate = amount / (t1 - t0)
    for i in range(first, last + 1):
        lo, hi = max(t0, i * window_s), min(t1, (i + 1) * window_s)
        if hi > lo:
            row[i] += rate * (hi - lo)

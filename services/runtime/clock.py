"""The clock every shell reads: wall time, optionally compressed for simulated engines.

With simulated engines running `X` virtual seconds per wall second (`PRORSA_TIME_SCALE=X`), every service, the
client SDK and the rollout driver must agree on one notion of a second, or rates, horizons and intervals stop
meaning the same thing across the bus. So shells never call `time.time()` / `time.monotonic()` directly: they call
`now_s()` / `monotonic_s()`, which return scaled seconds (virtual seconds = wall seconds × X), and `sleep_s(d)`
waits `d` virtual seconds. With real engines X is 1 and these are the plain clocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator

_SCALE_ENV = "PRORSA_TIME_SCALE"


def time_scale() -> float:
    """Virtual seconds per wall second (≥ 1e-6); $PRORSA_TIME_SCALE, default 1."""
    try:
        scale = float(os.environ.get(_SCALE_ENV, "1") or 1)
    except ValueError as exc:
        raise ValueError(f"{_SCALE_ENV} must be a number, got {os.environ.get(_SCALE_ENV)!r}") from exc
    return max(scale, 1e-6)


def set_time_scale(scale: float) -> None:
    """Set the scale for this process and the children it starts."""
    os.environ[_SCALE_ENV] = repr(float(scale))


@contextlib.contextmanager
def time_scale_set(scale: float) -> Iterator[None]:
    """`set_time_scale(scale)` for the block, then the previous scale again (a run inside a longer-lived process,
    such as a test session, must not leave its speed-up behind for whatever runs next)."""
    previous = os.environ.get(_SCALE_ENV)
    set_time_scale(scale)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_SCALE_ENV, None)
        else:
            os.environ[_SCALE_ENV] = previous


def now_s() -> float:
    """Unix time in scaled seconds (a timestamp comparable across processes that share the scale)."""
    return time.time() * time_scale()


def monotonic_s() -> float:
    """Monotonic time in scaled seconds (for durations)."""
    return time.monotonic() * time_scale()


async def sleep_s(seconds: float) -> None:
    """Sleep `seconds` scaled seconds."""
    await asyncio.sleep(max(0.0, seconds) / time_scale())

"""The clock every shell reads: wall time, optionally compressed for simulated engines.

With simulated engines running `X` virtual seconds per wall second (`PRORSA_TIME_SCALE=X`), every service, the
client SDK and the rollout driver must agree on one notion of a second, or rates, horizons and intervals stop
meaning the same thing across the bus. So shells never call `time.time()` / `time.monotonic()` for anything they
stamp, compare with a stamp or model: they hold a `Clock`, whose `now_s()` / `monotonic_s()` return scaled seconds
(virtual seconds = wall seconds × X) and whose `sleep_s(d)` waits `d` virtual seconds. With real engines X is 1 and
these are the plain clocks. (Raw wall clocks remain where a real duration is meant: process supervision, bus
reconnect deadlines, event-loop lag; each such place says so.)

The scale is fixed when a shell is built: it is handed a `Clock` (or takes `Clock.from_env()` once, in its
constructor) and passes that same object to its helpers, so one process never mixes two scales, and a change of the
variable later does not move a running service's clock. `$PRORSA_TIME_SCALE` is only how a launcher configures the
processes it starts (`set_time_scale`, `time_scale_set`: the children inherit the environment).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

_SCALE_ENV = "PRORSA_TIME_SCALE"
_MIN_SCALE = 1e-6


@dataclass(frozen=True, slots=True)
class Clock:
    """Scaled wall time: `scale` virtual seconds per wall second."""

    scale: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"the time scale must be a positive number, got {self.scale!r}")

    @classmethod
    def from_env(cls) -> Clock:
        """The clock $PRORSA_TIME_SCALE configures (read now, once; unset: scale 1)."""
        scale = scale_from_env()
        return cls(1.0 if scale is None else scale)

    @property
    def time_scale(self) -> float:
        """Virtual seconds per wall second."""
        return self.scale

    def now_s(self) -> float:
        """Unix time in scaled seconds (a timestamp comparable across processes that share the scale)."""
        return time.time() * self.scale

    def monotonic_s(self) -> float:
        """Monotonic time in scaled seconds (for durations)."""
        return time.monotonic() * self.scale

    def wall_s(self, virtual_s: float) -> float:
        """Wall seconds that `virtual_s` scaled seconds last."""
        return virtual_s / self.scale

    async def sleep_s(self, seconds: float) -> None:
        """Sleep `seconds` scaled seconds."""
        await asyncio.sleep(self.wall_s(max(0.0, seconds)))


def scale_from_env() -> float | None:
    """$PRORSA_TIME_SCALE (≥ 1e-6), or None when it is unset or empty. Raises ValueError if it is not a number."""
    raw = os.environ.get(_SCALE_ENV, "")
    if not raw:
        return None
    try:
        scale = float(raw)
    except ValueError as exc:
        raise ValueError(f"{_SCALE_ENV} must be a number, got {raw!r}") from exc
    return max(scale, _MIN_SCALE)


def set_time_scale(scale: float) -> None:
    """Set the scale for this process and the children it starts (for shells built from now on)."""
    os.environ[_SCALE_ENV] = repr(float(scale))


@contextlib.contextmanager
def time_scale_set(scale: float) -> Iterator[None]:
    """`set_time_scale(scale)` for the block, then the previous scale again (a run inside a longer-lived process,
    such as a test session, must not leave its speed-up behind for whatever runs next). Shells built inside the
    block keep the scale after it."""
    previous = os.environ.get(_SCALE_ENV)
    set_time_scale(scale)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_SCALE_ENV, None)
        else:
            os.environ[_SCALE_ENV] = previous

"""The scaled clock: a `Clock` keeps the scale it was built with, reads scaled time, and sleeps scaled seconds."""

from __future__ import annotations

import time

import pytest

from services.runtime.clock import Clock, scale_from_env, time_scale_set


def test_a_clock_keeps_the_scale_it_was_built_with(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRORSA_TIME_SCALE", "25")
    clock = Clock.from_env()
    monkeypatch.setenv("PRORSA_TIME_SCALE", "2")
    assert clock.time_scale == 25.0
    with time_scale_set(7.0):
        assert clock.time_scale == 25.0 and Clock.from_env().time_scale == 7.0
    assert Clock.from_env().time_scale == 2.0


def test_the_environment_sets_the_scale_or_leaves_it_at_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRORSA_TIME_SCALE", raising=False)
    assert scale_from_env() is None and Clock.from_env().time_scale == 1.0
    monkeypatch.setenv("PRORSA_TIME_SCALE", "")
    assert scale_from_env() is None
    monkeypatch.setenv("PRORSA_TIME_SCALE", "fast")
    with pytest.raises(ValueError, match="PRORSA_TIME_SCALE"):
        Clock.from_env()
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            Clock(bad)


def test_now_and_monotonic_are_scaled() -> None:
    clock = Clock(50.0)
    before, now, after = time.time(), clock.now_s(), time.time()
    assert 50.0 * before <= now <= 50.0 * after
    before, mono, after = time.monotonic(), clock.monotonic_s(), time.monotonic()
    assert 50.0 * before <= mono <= 50.0 * after


def test_wall_s_converts_virtual_to_wall_seconds() -> None:
    assert Clock(20.0).wall_s(10.0) == 0.5
    assert Clock().wall_s(3.0) == 3.0


async def test_sleep_waits_the_wall_share_of_its_virtual_seconds() -> None:
    clock = Clock(40.0)
    t0 = time.monotonic()
    await clock.sleep_s(8.0)  # 0.2 wall seconds
    waited = time.monotonic() - t0
    assert 0.19 <= waited < 1.0  # a loaded machine may wake late, never early
    t0 = time.monotonic()
    await clock.sleep_s(-5.0)  # a deadline already passed: no wait
    assert time.monotonic() - t0 < 0.1

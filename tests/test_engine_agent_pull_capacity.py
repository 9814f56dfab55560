"""Capacity-driven pulling (pure): tables of load in → pull sizes out."""

from __future__ import annotations

import pytest

from services.engine_agent.pull_capacity import (
    EngineLimits,
    Ewma,
    HeldWork,
    decode_pull_size,
    kv_reservation_tokens,
    prefill_pull_size,
    pull_size,
)

LIMITS = EngineLimits(max_batch=8, kv_capacity_tokens=100_000, prefill_budget_tokens=10_000, max_fetch=4)


@pytest.mark.parametrize(
    ("held", "est", "expected"),
    [
        (HeldWork(), 2_000, 4),  # 5 fit the budget, max_fetch caps at 4
        (HeldWork(), 5_000, 2),
        (HeldWork(prefill_jobs=1, prefill_tokens=9_000), 2_000, 1),  # under budget: always at least one
        (HeldWork(prefill_jobs=2, prefill_tokens=10_000), 100, 0),  # budget full
        (HeldWork(prefill_jobs=8, prefill_tokens=800), 100, 0),  # no batch slot
        (HeldWork(), 50_000, 1),  # a prompt larger than the budget still runs, alone
    ],
)
def test_prefill_pull_size(held: HeldWork, est: float, expected: int) -> None:
    assert prefill_pull_size(LIMITS, held, est) == expected


@pytest.mark.parametrize(
    ("held", "est", "expected"),
    [
        (HeldWork(), 10_000, 4),
        (HeldWork(decode_jobs=6, kv_reserved_tokens=60_000), 10_000, 2),  # two slots left
        (HeldWork(decode_jobs=2, kv_reserved_tokens=80_000), 10_000, 2),  # KV for two more
        (HeldWork(decode_jobs=2, kv_reserved_tokens=95_000), 10_000, 0),  # KV full
        (HeldWork(decode_jobs=8, kv_reserved_tokens=8), 1, 0),  # batch full
        (HeldWork(), 500_000, 1),  # an empty engine takes one whatever its size
    ],
)
def test_decode_pull_size(held: HeldWork, est: float, expected: int) -> None:
    assert decode_pull_size(LIMITS, held, est) == expected


@pytest.mark.parametrize(
    ("role", "kind", "expected"),
    [
        ("prefill", "prefill", 4),
        ("prefill", "decode", 0),
        ("decode", "prefill", 0),
        ("decode", "decode", 2),
        ("mixed", "prefill", 2),  # both limits: KV room for two decodes
        ("mixed", "decode", 2),
    ],
)
def test_pull_size_by_role(role: str, kind: str, expected: int) -> None:
    held = HeldWork(decode_jobs=2, kv_reserved_tokens=80_000)
    assert pull_size(role, kind, LIMITS, held, 1_000, 10_000) == expected  # type: ignore[arg-type]


def test_helpers() -> None:
    assert kv_reservation_tokens(1_000, 200) == 1_200
    e = Ewma(100.0, alpha=0.5)
    assert e.observe(200.0) == 150.0

"""The switch rule (pure): which switches are in place, what a restart drains, and the output estimate drain
decisions read instead of any true output length."""

from __future__ import annotations

import math

import pytest

from services.engine_agent.switch_rule import (
    DEFAULT_OUTPUT_TOKENS,
    MIN_ALPHA,
    DrainItem,
    OutputEstimate,
    finishes_in_drain,
    job_fate,
    plan_drain,
    switch_kind,
)


@pytest.mark.parametrize(
    ("role", "restart_roles", "kind"),
    [
        ("decode", (), "in_place"),  # one layout for every role: kv_both, nothing restarts
        ("decode", ("prefill",), "in_place"),
        ("decode", ("decode",), "restart"),  # its layout differs (`--role-engine-arg decode:...`)
        ("mixed", ("decode", "mixed"), "restart"),
    ],
)
def test_a_switch_restarts_only_into_a_role_of_another_layout(
    role: str, restart_roles: tuple[str, ...], kind: str
) -> None:
    assert switch_kind(role, restart_roles) == kind


def test_an_unknown_role_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="sideways"):
        switch_kind("sideways", ())


@pytest.mark.parametrize(
    ("kind", "fate"), [("prefill", "finish"), ("decode", "drain"), ("generate", "drain")]
)
def test_a_restart_finishes_prefills_and_drains_everything_that_decodes(kind: str, fate: str) -> None:
    assert job_fate(kind) == fate  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("remaining", "s_per_token", "bound", "stays"),
    [
        (100, 0.01, 1.0, True),  # 1 s: exactly within the bound
        (101, 0.01, 1.0, False),
        (0, 5.0, 0.0, True),  # nothing left to decode
        (-3, 0.01, 0.0, True),  # overshot its expected length: as good as done
        (10, 0.0, 0.0, True),  # an inter-token time of 0: it ends at once
    ],
)
def test_a_decode_stays_only_if_it_ends_within_the_drain_bound(
    remaining: int, s_per_token: float, bound: float, stays: bool
) -> None:
    assert finishes_in_drain(remaining, s_per_token, bound) is stays


def test_the_estimate_is_the_mean_of_the_first_answers_then_follows_drift() -> None:
    est = OutputEstimate()
    assert est.value == DEFAULT_OUTPUT_TOKENS and est.answers == 0  # the prior, until an answer ends
    for n in (100, 200, 300):
        assert est.observe(n)
    assert est.value == pytest.approx(200.0)  # a plain mean over the first answers: the prior is gone
    for _ in range(500):
        est.observe(1_000)
    assert est.value == pytest.approx(1_000.0, rel=1e-3)  # answers that lengthen pull it along
    before = est.value
    est.observe(0)
    assert est.value == pytest.approx(before * (1 - MIN_ALPHA))  # one answer weighs MIN_ALPHA at most


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_an_impossible_answer_length_is_counted_and_left_out(bad: float) -> None:
    est = OutputEstimate()
    est.observe(300)
    assert not est.observe(bad)
    assert (est.value, est.answers, est.rejected) == (300.0, 1, 1)


@pytest.mark.parametrize(
    ("produced", "cap", "remaining"),
    [
        (0, 0, 400),  # expected to run to the mean
        (150, 0, 250),
        (400, 0, 0),  # at the mean: expected to end now
        (900, 0, 0),  # past it: no guess beyond; the drain bound hands it on if it runs on
        (150, 200, 50),  # its max_tokens ends it sooner
        (-5, 0, 400),  # a negative count reads as none produced
    ],
)
def test_remaining_output_is_read_from_the_estimate(produced: int, cap: int, remaining: int) -> None:
    est = OutputEstimate()
    est.observe(400)
    assert est.remaining(produced, cap) == remaining


def test_plan_drain_keeps_what_the_estimate_ends_within_the_bound() -> None:
    est = OutputEstimate()
    est.observe(600)
    items = [
        DrainItem("near", produced_tokens=550, cap_tokens=0, s_per_token=0.02),  # 50 left: 1 s
        DrainItem("edge", produced_tokens=100, cap_tokens=0, s_per_token=0.02),  # 500 left: 10 s
        DrainItem("young", produced_tokens=10, cap_tokens=0, s_per_token=0.02),  # 590 left: 11.8 s
        DrainItem("capped", produced_tokens=10, cap_tokens=20, s_per_token=0.02),  # max_tokens: 10 left
    ]
    assert plan_drain(items, est, drain_bound_s=10.0) == (["near", "edge", "capped"], ["young"])
    assert plan_drain(items, est, drain_bound_s=0.0) == ([], ["near", "edge", "young", "capped"])

"""What the prorsa policy charges for a move: an in-place switch is the profile's `role_switch_s` with nothing
drained; a move that fills a role some mover's layout differs for is a restart — its drain plus an engine start
(`engine_start_s`), read from the engines' `restart_roles`."""

from __future__ import annotations

import pytest

from services.allocator.policies.common import Split
from services.allocator.policy import ClusterView, EngineView, PolicyError
from services.allocator.registry import make_policy
from services.runtime.model_profiles import load_profile

PROFILE = load_profile("deepseek-v3.2")


def engine(i: int, role: str, restart_roles: tuple[str, ...] = ()) -> EngineView:
    """A busy engine: a decode batch of 8 with much output left, so a drain would take long."""
    return EngineView(
        engine_id=f"e{i}",
        role=role,
        running=8,
        waiting=0,
        queued_prefill_tokens=0,
        decode_batch=8 if role != "prefill" else 0,
        kv_used_tokens=8 * 40_000,
        kv_capacity_tokens=3_000_000,
        in_flight_tokens=200_000,
        switching=False,
        restart_roles=restart_roles,
    )


def costs(engines: list[EngineView]):  # type: ignore[no-untyped-def]
    policy = make_policy("prorsa", len(engines), profile=PROFILE)
    view = ClusterView(
        now=0.0,
        engines=tuple(engines),
        prefill_queue_tokens=0,
        decode_queue_len=0,
        prefill_tokens_per_s=0.0,
        decode_tokens_per_s=0.0,
    )
    return policy._switch_costs(view)  # type: ignore[attr-defined]


def test_a_move_between_equal_layouts_costs_the_in_place_switch_and_no_drain() -> None:
    c = costs([engine(0, "prefill"), engine(1, "decode"), engine(2, "decode"), engine(3, "decode")])
    seconds, meanwhile = c.of(Split(1, 3), Split(2, 2))
    assert seconds == PROFILE.role_switch_s  # the busy decode mover drains nothing
    assert meanwhile == Split(1, 2)  # the mover pulls nothing new while it switches


def test_a_move_into_a_role_of_another_layout_costs_a_drain_and_an_engine_start() -> None:
    c = costs([engine(0, "prefill"), *(engine(i, "decode", restart_roles=("prefill",)) for i in (1, 2, 3))])
    seconds, meanwhile = c.of(Split(1, 3), Split(2, 2))
    assert seconds > PROFILE.engine_start_s > PROFILE.role_switch_s  # a drain, then a restart
    assert seconds <= PROFILE.engine_start_s + 5.0  # the drain is bounded by the drain timeout
    assert meanwhile == Split(1, 2)
    # The other way round fills the decode role, whose layout is theirs: in place.
    back, _ = c.of(Split(1, 3), Split(0, 4))
    assert back == PROFILE.role_switch_s


def test_an_unknown_restart_role_is_refused_by_name() -> None:
    with pytest.raises(PolicyError, match="sideways"):
        engine(0, "decode", restart_roles=("sideways",))

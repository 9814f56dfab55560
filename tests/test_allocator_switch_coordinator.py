"""The allocator's command rules: stale stats, one command in flight, monotonic epochs, no empty role, bounded churn."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proto import EngineStats, RoleSwitchAck
from services.allocator.switch_coordinator import DECODE_CAPABLE, PREFILL_CAPABLE, SwitchCoordinator

ROLES = ("prefill", "decode", "mixed")


def stats(
    e: str, role: str, ts: float, epoch: int = 0, work: int = 0, switching: bool = False
) -> EngineStats:
    return EngineStats(
        engine_id=e, ts_s=ts, role=role, epoch=epoch, in_flight_tokens=work, switching=switching
    )


def fleet(roles: dict[str, str], now: float = 0.0, **kw) -> SwitchCoordinator:
    c = SwitchCoordinator(max_concurrent_fraction=1.0, **kw)
    for e, r in roles.items():
        c.observe_stats(stats(e, r, now), now)
    return c


def test_commands_move_toward_target_with_increasing_epochs() -> None:
    c = fleet({"a": "mixed", "b": "mixed", "c": "mixed"})
    cmds = c.commands_for({"a": "prefill", "b": "decode", "c": "decode"}, now=1.0)
    assert [(x.engine_id, x.role) for x in cmds] == [("a", "prefill"), ("b", "decode"), ("c", "decode")]
    assert [x.epoch for x in cmds] == [1, 2, 3]


def test_one_command_in_flight_and_no_blind_retry() -> None:
    c = fleet({"a": "mixed", "b": "decode"}, ack_timeout_s=10.0)
    assert len(c.commands_for({"a": "prefill"}, now=1.0)) == 1
    assert c.commands_for({"a": "prefill"}, now=2.0) == []  # waiting for the ack
    assert c.commands_for({"a": "decode"}, now=3.0) == []  # even for a new target
    c.observe_stats(stats("a", "mixed", ts=11.0), now=11.5)
    c.observe_stats(stats("b", "decode", ts=11.0), now=11.5)
    cmds = c.commands_for({"a": "prefill"}, now=12.0)  # timed out; stats say not applied: a new epoch
    assert c.timeouts == 1 and [x.epoch for x in cmds] == [2]


def test_ack_clears_and_stats_with_applied_epoch_clear_lost_acks() -> None:
    c = fleet({"a": "mixed", "b": "mixed"})
    (cmd,) = c.commands_for({"a": "prefill"}, now=1.0)
    c.observe_ack(RoleSwitchAck(engine_id="a", epoch=cmd.epoch, role="prefill", ok=True), now=2.0)
    assert c.outstanding == {}
    (cmd2,) = c.commands_for({"b": "decode"}, now=3.0)
    c.observe_stats(stats("b", "decode", ts=4.0, epoch=cmd2.epoch), now=4.0)  # ack lost, stats tell
    assert c.outstanding == {}


def test_stale_engines_are_left_alone() -> None:
    c = fleet({"a": "mixed", "b": "mixed", "c": "decode"}, stale_after_s=5.0)
    c.observe_stats(stats("b", "mixed", ts=9.0), now=9.0)
    c.observe_stats(stats("c", "decode", ts=9.0), now=9.0)
    cmds = c.commands_for({"a": "prefill", "b": "prefill"}, now=9.5)
    assert [x.engine_id for x in cmds] == ["b"]


def test_never_empty_a_role_with_demand() -> None:
    c = fleet({"a": "prefill", "b": "decode"})
    assert c.commands_for({"a": "decode", "b": "decode"}, now=1.0, prefill_demand=True) == []
    assert len(c.commands_for({"a": "decode", "b": "decode"}, now=1.0, prefill_demand=False)) == 1


def test_least_in_flight_work_switches_first_and_churn_is_bounded() -> None:
    c = SwitchCoordinator(max_concurrent_fraction=0.25)
    for i, work in enumerate([500, 10, 300, 0, 50, 70, 90, 20]):
        c.observe_stats(stats(f"e{i}", "decode", ts=0.0, work=work), now=0.0)
    cmds = c.commands_for({f"e{i}": "prefill" for i in range(8)}, now=0.5)
    # e3 holds nothing: it switches outside the budget of two, which the two busy engines with least work take
    assert [x.engine_id for x in cmds] == ["e3", "e1", "e7"]
    assert (
        c.commands_for({f"e{i}": "prefill" for i in range(8)}, now=0.6) == []
    )  # the busy two still switching


def test_idle_engines_switch_outside_the_budget_busy_ones_within_it() -> None:
    c = SwitchCoordinator(max_concurrent_fraction=0.25)  # 10 engines: two busy ones at a time
    work = [0, 0, 0, 0, 0, 0, 400, 100, 300, 200]
    for i, w in enumerate(work):
        c.observe_stats(stats(f"e{i}", "mixed", ts=0.0, work=w), now=0.0)
    target = {f"e{i}": "decode" if i % 2 else "prefill" for i in range(10)}
    cmds = c.commands_for(target, now=0.5)
    assert sorted(x.engine_id for x in cmds) == ["e0", "e1", "e2", "e3", "e4", "e5", "e7", "e9"]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from(ROLES), min_size=1, max_size=8),
    st.lists(
        st.tuples(
            st.lists(st.sampled_from(ROLES), min_size=8, max_size=8),
            st.booleans(),
            st.booleans(),
            st.floats(0, 3),
        ),
        max_size=12,
    ),
)
def test_properties(initial: list[str], plans: list) -> None:
    ids = [f"e{i}" for i in range(len(initial))]
    c = SwitchCoordinator(max_concurrent_fraction=0.5, ack_timeout_s=2.0)
    now, last_epoch = 0.0, 0
    for e, r in zip(ids, initial, strict=True):
        c.observe_stats(stats(e, r, now), now)
    for target_roles, pd, dd, dt in plans:
        now += dt
        before = c.current_roles(now)
        cmds = c.commands_for(
            dict(zip(ids, target_roles, strict=False)), now, prefill_demand=pd, decode_demand=dd
        )
        after = c.current_roles(now)
        assert sorted(after) == sorted(before)  # engines conserved
        for cmd in cmds:  # epochs only increase
            assert cmd.epoch > last_epoch
            last_epoch = cmd.epoch
        vals = set(after.values())
        if vals:  # no role with demand left empty (unless it was already empty)
            if pd and set(before.values()) & PREFILL_CAPABLE:
                assert vals & PREFILL_CAPABLE
            if dd and set(before.values()) & DECODE_CAPABLE:
                assert vals & DECODE_CAPABLE
        # engines apply commands and ack them; duplicates and stale acks change nothing
        for cmd in cmds:
            ack = RoleSwitchAck(engine_id=cmd.engine_id, epoch=cmd.epoch, role=cmd.role, ok=True)
            c.observe_ack(ack, now)
            c.observe_ack(ack, now)
            c.observe_stats(stats(cmd.engine_id, cmd.role, now, epoch=cmd.epoch), now)
        for e in ids:
            if e not in {x.engine_id for x in cmds}:
                c.observe_stats(stats(e, c.stats[e].role, now, epoch=c.stats[e].epoch), now)
        assert c.epoch >= last_epoch


def test_a_staged_move_goes_on_as_its_switches_land() -> None:
    """`follow_up`: an ack frees the budget, and the rest of the last target goes out then, not a plan later; an
    acknowledged switch counts as applied until the stats show it (never commanded again)."""
    c = SwitchCoordinator(max_concurrent_fraction=0.25)  # 8 busy engines: two at a time
    for i in range(8):
        c.observe_stats(stats(f"e{i}", "mixed", ts=0.0, work=100 + i), now=0.0)
    target = {f"e{i}": "prefill" if i < 5 else "decode" for i in range(8)}
    first = c.commands_for(target, now=1.0, reason="move")
    assert [x.engine_id for x in first] == ["e0", "e1"]
    assert c.follow_up(now=2.0) == []  # nothing has landed: the budget is spent
    ack = RoleSwitchAck(engine_id="e0", epoch=first[0].epoch, role="prefill", ok=True)
    assert c.observe_ack(ack, now=3.0)  # it landed
    assert not c.observe_ack(ack, now=3.0)  # the same ack again (the reply and the ack subject): nothing more
    nxt = c.follow_up(now=3.0)
    assert [(x.engine_id, x.role, x.reason) for x in nxt] == [("e2", "prefill", "move")]
    assert c.current_roles(3.0)["e0"] == "prefill"  # acked, its stats (still "mixed") not yet caught up
    c.observe_ack(RoleSwitchAck(engine_id="e1", epoch=first[1].epoch, role="prefill", ok=True), now=3.5)
    assert [x.engine_id for x in c.follow_up(now=3.5)] == ["e3"]  # e0 is not commanded again
    c.observe_stats(stats("e0", "prefill", ts=4.0, epoch=first[0].epoch, work=100), now=4.0)
    assert "e0" not in c.applied  # the stats caught up


def test_follow_up_leaves_a_refused_switch_to_the_next_decision() -> None:
    c = SwitchCoordinator(max_concurrent_fraction=0.25)
    for i in range(4):
        c.observe_stats(stats(f"e{i}", "mixed", ts=0.0, work=100 + i), now=0.0)
    (cmd,) = c.commands_for({"e0": "prefill", "e1": "decode"}, now=1.0)
    assert not c.observe_ack(RoleSwitchAck(engine_id="e0", epoch=cmd.epoch, role="mixed", ok=False), now=2.0)
    assert c.applied == {} and c.refused == 1
    # the refusal leaves the next decision to ask again: a follow-up goes on with the rest only
    assert [x.engine_id for x in c.follow_up(now=2.0)] == ["e1"]

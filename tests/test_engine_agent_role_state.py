"""The role-switch core: tables of commands in → decisions out, and hypothesis properties of epoch fencing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import ROLES, RoleSwitchCommand
from services.engine_agent import role_state as rs
from services.engine_agent.role_state import (
    initial_state,
    on_command,
    on_switch_done,
    on_switch_failed,
)

ENGINE = "e-1"


def cmd(epoch: int, role: str = "prefill", engine_id: str = ENGINE) -> RoleSwitchCommand:
    return RoleSwitchCommand(engine_id=engine_id, role=role, epoch=epoch, issued_s=0.0)  # type: ignore[arg-type]


def test_a_newer_epoch_starts_a_switch_that_completes_into_the_new_role() -> None:
    s0 = initial_state(ENGINE, "decode")
    s1, d = on_command(s0, cmd(3), now=10.0)
    assert (d.kind, d.start, s1.phase, s1.newest_epoch, s1.role) == ("start", cmd(3), "draining", 3, "decode")
    s2, ack, nxt = on_switch_done(s1, now=12.5, migrated=2, drained=5)
    assert nxt is None and s2.phase == "serving" and s2.role == "prefill" and s2.applied_epoch == 3
    assert (ack.ok, ack.epoch, ack.role, ack.switch_s, ack.migrated_requests, ack.drained_requests) == (
        True,
        3,
        "prefill",
        2.5,
        2,
        5,
    )


@pytest.mark.parametrize(
    ("epoch", "kind"),
    [(2, "stale"), (3, "replay"), (4, "start")],
)
def test_after_a_completed_switch(epoch: int, kind: str) -> None:
    s, _ = on_command(initial_state(ENGINE, "mixed"), cmd(3), 0.0)
    s, first_ack, _ = on_switch_done(s, 1.0)
    after, d = on_command(s, cmd(epoch, role="decode"), 2.0)
    assert d.kind == kind
    if kind == "replay":
        assert d.ack is first_ack and after == s  # the very same ack; nothing changes
    if kind == "stale":
        assert d.ack is not None and not d.ack.ok and d.ack.error.startswith("stale_command") and after == s
        assert d.ack.role == "prefill"  # the role the engine has


def test_duplicates_of_a_running_switch_wait_for_its_ack() -> None:
    s, _ = on_command(initial_state(ENGINE, "mixed"), cmd(7), 0.0)
    again, d = on_command(s, cmd(7), 0.5)
    assert d.kind == "wait" and again == s


def test_commands_during_a_switch_queue_and_the_newest_supersedes() -> None:
    s, _ = on_command(initial_state(ENGINE, "mixed"), cmd(1, "prefill"), 0.0)
    s, d = on_command(s, cmd(2, "decode"), 0.1)
    assert d.kind == "queued" and d.superseded is None
    s, d = on_command(s, cmd(3, "mixed"), 0.2)
    assert d.kind == "queued" and d.superseded is not None
    assert (d.superseded.epoch, d.superseded.ok) == (2, False)
    s, ack, nxt = on_switch_done(s, 1.0)
    assert ack.epoch == 1 and nxt == cmd(3, "mixed") and s.phase == "draining" and s.role == "prefill"
    s, ack, nxt = on_switch_done(s, 2.0)
    assert (ack.epoch, ack.switch_s, nxt, s.role, s.phase) == (3, 1.0, None, "mixed", "serving")


def test_misaddressed_and_invalid_commands_are_rejected() -> None:
    s0 = initial_state(ENGINE, "mixed")
    s, d = on_command(s0, cmd(1, engine_id="other"), 0.0)
    assert (d.kind, d.error_kind, s) == ("rejected", "wrong_engine", s0)
    odd = RoleSwitchCommand(engine_id=ENGINE, role="sideways", epoch=1, issued_s=0.0)  # type: ignore[arg-type]
    s, d = on_command(s0, odd, 0.0)
    assert (d.kind, d.error_kind, s) == ("rejected", "invalid_command", s0)


def test_a_failed_switch_keeps_the_role_and_consumes_the_epoch() -> None:
    s, _ = on_command(initial_state(ENGINE, "mixed"), cmd(4, "decode"), 0.0)
    s, ack, _ = on_switch_failed(s, 1.0, "backend refused")
    assert (s.role, s.applied_epoch, ack.ok) == ("mixed", 4, False) and "backend refused" in ack.error
    _, d = on_command(s, cmd(4, "decode"), 2.0)
    assert d.kind == "replay" and d.ack == ack


def test_completing_without_a_switch_is_our_bug() -> None:
    with pytest.raises(rs.RoleStateError, match="no role switch is running"):
        on_switch_done(initial_state(ENGINE, "mixed"), 0.0)
    with pytest.raises(ValueError, match="unknown role"):
        initial_state(ENGINE, "sideways")


events = st.lists(
    st.one_of(
        st.tuples(st.just("cmd"), st.integers(1, 12), st.sampled_from(ROLES), st.sampled_from([ENGINE, "x"])),
        st.tuples(st.just("done"), st.integers(0, 3), st.just(""), st.just("")),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(events)
def test_epochs_only_increase_and_stale_or_duplicate_commands_change_nothing(evs: list[tuple]) -> None:
    s = initial_state(ENGINE, "mixed")
    now = 0.0
    answered: dict[int, int] = {}
    for ev in evs:
        now += 1.0
        before = s
        if ev[0] == "done":
            if s.active is None:
                continue
            s, ack, _ = on_switch_done(s, now, migrated=ev[1])
            answered[ack.epoch] = answered.get(ack.epoch, 0) + 1
        else:
            _, epoch, role, engine = ev
            s, d = on_command(s, cmd(epoch, role, engine), now)
            if d.kind in ("stale", "replay", "wait", "rejected"):
                assert s == before
            if d.kind == "stale":
                assert d.ack is not None and d.ack.epoch < s.newest_epoch
            if d.superseded is not None:
                answered[d.superseded.epoch] = answered.get(d.superseded.epoch, 0) + 1
        assert s.newest_epoch >= before.newest_epoch and s.applied_epoch >= before.applied_epoch
        assert s.applied_epoch <= s.newest_epoch
        assert (s.active is None) == (s.phase == "serving")
        assert s.queued is None or s.active is not None
    assert all(n == 1 for n in answered.values())  # every accepted epoch is answered once (ok or superseded)


PURE_MODULES = [
    "role_state.py",
    "switch_rule.py",
    "pull_capacity.py",
    "jobs.py",
    "job_core.py",
    "engine_core.py",
    "prefix_cache.py",
    "outputs.py",
    "solo_engine.py",
    "backends/sim_tokens.py",
]


@pytest.mark.parametrize("name", PURE_MODULES)
def test_cores_import_no_io_clock_or_randomness(name: str) -> None:
    path = Path(rs.__file__).parent / name
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"asyncio", "nats", "time", "random"}, f"{name} imports {imported}"

"""Field bounds (issue 14): epochs and policy versions cannot be absurd on the wire, cannot jump absurdly at an
engine, and weights load only from under the engine's weights root."""

from __future__ import annotations

import os

import pytest

import proto
from proto import MAX_COUNTER, PolicyVersionUpdate, ProtoError, RoleSwitchCommand
from services.engine_agent.role_state import initial_state, on_command
from services.engine_agent.weights_guard import check_update, resolve, weights_path_problem
from services.runtime.auth import BusUser, authorization_config, permissions


def _raw(cls: type, field: str, value: int, **fields: object) -> bytes:
    msg = cls(**{field: 1}, **fields)
    return proto.encode(msg).replace(f'"{field}":1'.encode(), f'"{field}":{value}'.encode())


@pytest.mark.parametrize("value", [2**53, 2**63, 2**64 - 1, 2**64, -1])
@pytest.mark.parametrize(
    ("cls", "field", "fields"),
    [
        (RoleSwitchCommand, "epoch", {"engine_id": "e0", "role": "decode", "issued_s": 0.0}),
        (PolicyVersionUpdate, "version", {"ts_s": 0.0}),
    ],
)
def test_absurd_counters_are_refused_on_decode_naming_the_field(cls, field, fields, value) -> None:
    with pytest.raises(ProtoError) as err:
        proto.decode(_raw(cls, field, value, **fields), "prorsa.x", cls)
    assert err.value.field == field and err.value.kind == "decode"
    ok = proto.decode(_raw(cls, field, MAX_COUNTER, **fields), "prorsa.x", cls)
    assert getattr(ok, field) == MAX_COUNTER


def test_an_epoch_may_not_jump_more_than_the_bound() -> None:
    state = initial_state("e0", "mixed", max_epoch_jump=100)
    cmd = RoleSwitchCommand(engine_id="e0", role="decode", epoch=101, issued_s=0.0)
    same, d = on_command(state, cmd, now=1.0)
    assert d.kind == "rejected" and d.error_kind == "epoch_jump" and same == state
    state, d = on_command(
        state, RoleSwitchCommand(engine_id="e0", role="decode", epoch=100, issued_s=0.0), 1.0
    )
    assert d.kind == "start" and state.newest_epoch == 100
    _, d = on_command(state, RoleSwitchCommand(engine_id="e0", role="prefill", epoch=201, issued_s=0.0), 2.0)
    assert d.error_kind == "epoch_jump"
    with pytest.raises(ValueError):
        initial_state("e0", "mixed", max_epoch_jump=0)


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("", ""),
        ("step-13", ""),
        ("ckpt/step-13", ""),
        ("{root}/step-13", ""),
        ("/etc/hostile-weights", "not under the weights root"),
        ("../etc/passwd", "'..' component"),
        ("step-13/../../x", "'..' component"),
        ("{root}/../outside", "'..' component"),
        ("{root}-sibling/w", "not under the weights root"),
        ("link-out/w", "not under the weights root"),  # a symlink inside the root pointing out of it
        ("a\x00b", "NUL"),
    ],
)
def test_weights_only_from_under_the_root(tmp_path, path, problem) -> None:
    root = tmp_path / "weights"
    root.mkdir()
    os.symlink("/etc", root / "link-out")
    path = path.replace("{root}", str(root))
    got = weights_path_problem(path, str(root))
    assert (problem in got) if problem else got == "", got
    if not problem and path:
        assert resolve(path, str(root)).startswith(str(root.resolve()) + os.sep)


def test_without_a_root_only_a_reload_from_the_model_path_is_taken() -> None:
    assert weights_path_problem("", "") == ""
    assert "no weights root" in weights_path_problem("/ckpt/step-1", "")


def test_policy_versions_may_not_jump_more_than_the_bound() -> None:
    ok = PolicyVersionUpdate(version=11, ts_s=0.0)
    assert check_update(ok, newest_version=10, max_version_jump=1, weights_root="") is None
    far = PolicyVersionUpdate(version=12, ts_s=0.0)
    refusal = check_update(far, newest_version=10, max_version_jump=1, weights_root="")
    assert refusal is not None and refusal.kind == "version_jump"
    hostile = PolicyVersionUpdate(version=11, ts_s=0.0, weights_path="/etc/hostile-weights")
    refusal = check_update(hostile, newest_version=10, max_version_jump=1, weights_root="/ckpt")
    assert refusal is not None and refusal.kind == "weights_path"


def test_the_permission_table_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError):
        permissions("intruder", proto.Subjects())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        permissions("engine", proto.Subjects(), engine_id="a.b")
    with pytest.raises(ValueError):
        authorization_config([BusUser(permissions("trainer", proto.Subjects()))])  # no key, no password
    other = permissions("allocator", proto.Subjects("blue"))  # another namespace: nothing of "prorsa"
    assert all(not s.startswith("prorsa.") for s in (*other.publish, *other.subscribe))
    assert "blue.cmd.*" in other.publish and "$JS.API.STREAM.INFO.BLUE_WORK" in other.publish

"""The pure cores of the RL control plane: which update an engine takes and which turn it runs
(`services/engine_agent/weights_core.py`), and what the trainer's barrier concludes from engine reports
(`prorsa/client/weights.py`). Tables of events in, decisions out; no bus, no clock."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from prorsa.client.weights import WeightsView
from proto import EngineStats, GenerateRequest, PolicyVersionUpdate, SamplingParams, WeightsStatus
from services.engine_agent import weights_core as core

ROOT = Path(__file__).resolve().parents[1]


def upd(version: int, path: str = "") -> PolicyVersionUpdate:
    return PolicyVersionUpdate(version=version, ts_s=0.0, weights_path=path)


def req(min_version: int) -> GenerateRequest:
    return GenerateRequest(
        request_id="t:0",
        traj_id="t",
        turn=0,
        prompt_token_ids=[],
        prompt_len=10,
        sampling=SamplingParams(max_tokens=4),
        reply_to="r",
        min_policy_version=min_version,
    )


def take(state: core.WeightsState, version: int, revision: int = 1, path: str = "") -> tuple:
    return core.on_update(state, upd(version, path), revision, max_version_jump=100, weights_root="")


@pytest.mark.parametrize(
    ("served", "target", "phase", "version", "revision", "kind"),
    [
        (0, None, "serving", 1, 1, "load"),  # newer: load it
        (3, None, "serving", 3, 1, "ignore"),  # served already
        (3, None, "serving", 2, 1, "ignore"),  # older: versions only grow
        (3, 5, "loading", 4, 2, "ignore"),  # older than the one loading
        (3, 5, "loading", 6, 2, "load"),  # newer than the one loading: the next target
        (3, 5, "failed", 5, 7, "load"),  # a new revision of a failed version: the trainer retries
        (3, 5, "failed", 5, 1, "ignore"),  # the same revision again (watch + re-read): not a retry
        (3, 5, "failed", 5, 0, "ignore"),  # on the core subject: no revision, no retry
        (0, None, "serving", 101, 1, "refuse"),  # jumps too far
    ],
)
def test_which_update_an_engine_takes(served, target, phase, version, revision, kind) -> None:  # noqa: ANN001
    state = core.WeightsState(
        served=served, target=upd(target) if target else None, target_revision=1, phase=phase
    )
    after, decision = take(state, version, revision)
    assert decision.kind == kind
    if kind == "load":
        assert after.target is not None and after.target.version == version and after.wants_load
    if kind == "ignore":
        assert after == state


def test_a_path_outside_the_root_is_refused_and_reported_as_that_version_failed() -> None:
    state, decision = take(core.started(core.WeightsState()), 2, path="/etc/passwd")
    assert (
        decision.kind == "refuse" and decision.refusal is not None and decision.refusal.kind == "weights_path"
    )
    assert state.newest == 0 and not state.wants_load  # never a target
    status = core.status(state, "e", 1.0)
    assert (status.state, status.target_version, status.policy_version) == ("failed", 2, 0)
    assert "weights root" in status.error
    state, decision = take(state, 3)  # a good version later is still taken
    assert decision.kind == "load" and core.status(state, "e", 2.0).state == "serving"


def test_a_failed_load_keeps_the_old_weights_and_a_newer_target_survives_it() -> None:
    state, _ = take(core.started(core.WeightsState(served=1)), 2)
    state = core.failed(state, 2, "no such file")
    assert (state.phase, state.served, state.error, state.wants_load) == ("failed", 1, "no such file", False)
    state, _ = take(state, 3, revision=9)
    state = core.failed(state, 2, "late failure of the older one")  # the newer target is still loaded
    assert state.phase == "serving" and state.wants_load
    state = core.loaded(state, 3, 0.5)
    assert (state.served, state.phase, state.load_s, state.wants_load) == (3, "serving", 0.5, False)


@pytest.mark.parametrize(
    ("served", "target", "phase", "min_version", "decision"),
    [
        (2, None, "serving", 0, "run"),
        (2, None, "serving", 2, "run"),
        (2, 3, "loading", 3, "later"),  # loading it: give the turn back for now
        (2, 3, "loading", 4, "unavailable"),  # nobody knows version 4
        (2, 3, "failed", 3, "unavailable"),  # its load failed here
    ],
)
def test_admission_by_the_staleness_bound(served, target, phase, min_version, decision) -> None:  # noqa: ANN001
    state = core.WeightsState(served=served, target=upd(target) if target else None, phase=phase)
    assert core.admit(state, req(min_version)) == decision


def test_a_turn_is_older_than_a_bound_only_by_a_token_it_holds() -> None:
    assert core.holds_older(0, 1) and not core.holds_older(1, 1) and not core.holds_older(None, 5)


def _status(engine: str, version: int, ts: float, state: str = "serving", **kw: object) -> WeightsStatus:
    return WeightsStatus(engine_id=engine, ts_s=ts, policy_version=version, state=state, **kw)  # type: ignore[arg-type]


def test_the_barrier_waits_for_every_live_engine_and_names_the_laggards() -> None:
    view = WeightsView()
    for t in (0.0, 1.0, 2.0):
        view.observe_status(_status("a", 1, t), t)
        view.observe_status(_status("b", 0, t), t)
    waiting = view.barrier(1, 2.0)
    assert (waiting.state, waiting.lagging, waiting.served) == ("waiting", ["b"], {"a": 1, "b": 0})
    view.observe_status(_status("b", 1, 2.5), 2.5)
    assert view.barrier(1, 2.5).state == "done"
    # A restarted engine reports "starting" with its old figure: it is named until it serves the version.
    view.observe_status(_status("b", 1, 2.6, state="starting"), 2.6)
    assert view.barrier(1, 2.6).lagging == ["b"]


def test_a_silent_engine_leaves_the_barrier_after_three_of_its_intervals() -> None:
    view = WeightsView()
    for t in (0.0, 1.0, 2.0):
        view.observe_status(_status("a", 1, t), t)
        view.observe_status(_status("dead", 0, t), t)
    view.observe_status(_status("a", 1, 3.0), 3.0)
    view.observe_status(_status("a", 1, 4.0), 4.0)
    assert view.live(4.0) == ["a", "dead"]
    view.observe_status(_status("a", 1, 5.5), 5.5)
    assert view.live(5.5) == ["a"] and view.barrier(1, 5.5).state == "done"


def test_stats_alone_make_an_engine_live_and_a_reordered_status_is_dropped() -> None:
    view = WeightsView()
    view.observe_stats(EngineStats(engine_id="s", ts_s=1.0, role="mixed", epoch=0, policy_version=4), 1.0)
    assert view.barrier(4, 1.0).state == "done" and view.barrier(5, 1.0).lagging == ["s"]
    view.observe_status(_status("s", 5, 2.0), 2.0)
    view.observe_status(_status("s", 4, 1.5), 2.1)  # older stamp, arrived later
    assert view.served("s") == 5


def test_a_failure_fails_the_barrier_only_when_reported_for_this_attempt() -> None:
    view = WeightsView()
    view.observe_status(_status("a", 1, 10.0, state="failed", target_version=2, error="bad file"), 10.0)
    assert view.barrier(2, 10.0, since_ts_s=11.0).state == "waiting"  # from an earlier attempt
    verdict = view.barrier(2, 10.0, since_ts_s=9.0)
    assert (verdict.state, verdict.failed) == ("failed", {"a": "bad file"})


@pytest.mark.parametrize("path", ["services/engine_agent/weights_core.py", "prorsa/client/weights.py"])
def test_the_cores_do_no_io(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    imported = {
        (n.module or "").split(".")[0] if isinstance(n, ast.ImportFrom) else a.name.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert not imported & {"asyncio", "nats", "time", "random", "socket"}, imported

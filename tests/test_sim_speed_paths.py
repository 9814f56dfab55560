"""The simulator's shortcuts (kept for speed) give exactly what the general paths give."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from prorsa.sim import SimConfig, run_simulation
from prorsa.sim import events as ev
from prorsa.sim.core import Simulation
from prorsa.sim.engine import SimEngine
from prorsa.sim.runner import SimResult
from prorsa.sim.views import ViewBuilder
from prorsa.workload.spec import load_workload
from services.allocator.policy import FixedRolesPolicy
from services.allocator.registry import make_policy
from services.runtime.model_profiles import load_profile

_CONFIGS = {
    "static": dict(
        workload="profile:coding", engines=16, policy="static:4:12", batch_size=48, duration_s=240.0
    ),
    "async-aborts": dict(
        workload="swe", engines=12, policy="static:3:9", mode="async", steps=3, staleness=0, training_s=20.0
    ),
    "colocated": dict(workload="swe", engines=4, policy="colocated", batch_size=24, group_size=4),
}


def _json(config: dict) -> str:
    return json.dumps(run_simulation(SimConfig(**config)).to_json(), sort_keys=True)


def _workload(config: SimConfig):
    return load_workload(config.workload, batch_size=config.batch_size, group_size=1, seed=config.seed)


def _queued_enqueue(self: SimEngine, req, now: float) -> None:
    """`SimEngine.enqueue_prefill` without its shortcut: always through the queue and `_poke`."""
    req.remote = self.role == "prefill"
    t = req.traj
    req.est_tokens = req.context_tokens - self.cache.lookup(
        t.key, req.context_tokens, t.group_key, t.group_tokens
    )
    self.queue.append(req)
    self.queued_tokens += req.est_tokens
    self._poke(now)


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_prefill_shortcut_gives_the_queue_paths_result(name, monkeypatch):
    shortcuts = []
    start_prefill = SimEngine._start_prefill

    def counting(self, req, now, hit=None):
        shortcuts.append(hit is not None)
        start_prefill(self, req, now, hit)

    monkeypatch.setattr(SimEngine, "_start_prefill", counting)
    fast = _json(_CONFIGS[name])
    assert any(shortcuts) == (name != "colocated")  # the shortcut is for prefill-role engines only
    monkeypatch.setattr(SimEngine, "enqueue_prefill", _queued_enqueue)
    assert _json(_CONFIGS[name]) == fast


@dataclass
class _AlwaysDecides(FixedRolesPolicy):
    """The same fixed roles, but not the exact type the simulator recognises: it decides on every tick."""


def test_fixed_roles_shortcut_decides_like_the_policy(monkeypatch):
    builds = []
    build = ViewBuilder.build
    monkeypatch.setattr(ViewBuilder, "build", lambda self, now: builds.append(now) or build(self, now))
    config = SimConfig(**_CONFIGS["static"])
    profile = load_profile(config.profile)
    results = {}
    for policy in (make_policy(config.policy, config.engines), None):
        if policy is None:
            policy = _AlwaysDecides(
                name="static:4:12", interval_s=30.0, counts=(("prefill", 4), ("decode", 12))
            )
        builds.clear()
        sim = Simulation(config, _workload(config), profile, policy)
        results[type(policy)] = json.dumps(SimResult(config, sim, sim.run(), 0.0).to_json(), sort_keys=True)
        assert bool(builds) == (type(policy) is _AlwaysDecides)  # no view built while the roles are as fixed
    assert results[FixedRolesPolicy] == results[_AlwaysDecides]


class _Recorder:
    def __init__(self) -> None:
        self.kinds: set[str] = set()

    def on_event(self, kind: str, traj_id: str, now: float, **fields) -> None:
        self.kinds.add(kind)


def test_an_observer_attached_after_construction_sees_engine_events():
    config = SimConfig(**_CONFIGS["static"])
    profile = load_profile(config.profile)
    sim = Simulation(config, _workload(config), profile, make_policy(config.policy, config.engines))
    assert not any(hasattr(e, "__dict__") for e in sim.engines.values())  # slots in force (see SimEngine)
    recorder = _Recorder()
    sim.observer = recorder
    sim.run()
    assert {ev.PREFILL_DONE, ev.DECODE_STARTED, ev.DECODE_PROGRESS, ev.TURN_SUBMITTED} <= recorder.kinds

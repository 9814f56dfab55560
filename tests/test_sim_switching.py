"""The simulator's role switches follow the live agent's rule (`switch_rule.py`): in place only a switch to prefill
moves anything (its decodes, through its own prefix cache), and a restart's drain decides from what an engine can
know — its own estimate of answer lengths — never from the workload's true output lengths."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from prorsa.sim import engine_switching
from prorsa.sim.core import Simulation
from prorsa.sim.fixed_workload import FixedWorkload
from prorsa.sim.runner import SimConfig, SimResult
from prorsa.workload.types import TrajectorySpec, Turn
from services.allocator.policy import AllocatorPolicy, ClusterView, Plan
from services.engine_agent.switch_rule import finishes_in_drain
from services.runtime.model_profiles import load_profile

ROLES = ("prefill", "decode", "decode")


@dataclass
class _SwitchAt(AllocatorPolicy):
    """Prefill, decode, decode; at `at_s` the last engine becomes a prefill engine."""

    at_s: float = 8.0

    def initial_plan(self, engine_ids: Sequence[str]) -> Plan:
        return Plan(dict(zip(sorted(engine_ids), ROLES, strict=True)))

    def plan(self, view: ClusterView) -> Plan | None:
        if view.now < self.at_s:
            return None
        return Plan({max(e.engine_id for e in view.engines): "prefill"})


def _specs(long_outputs: list[int]) -> list[TrajectorySpec]:
    """Eight one-turn answers of 500 tokens that end before the switch, so the engines have seen some finish; then
    one trajectory per long answer, arriving every 0.3 s, so that at the switch they are at every stage of their
    answers: a 2k-token prompt and its answer, then one short turn."""
    short = [
        TrajectorySpec(traj_id=f"short{i}", task="math", turns=(Turn(2_000, 500, 0.0),)) for i in range(8)
    ]
    return short + [
        TrajectorySpec(
            traj_id=str(i), task="math", turns=(Turn(2_000, out, 1.0), Turn(100, 50, 0.0)), arrival_s=0.3 * i
        )
        for i, out in enumerate(long_outputs)
    ]


def _run(long_outputs: list[int], restart_roles: tuple[str, ...]) -> dict:  # type: ignore[type-arg]
    config = SimConfig(
        workload=FixedWorkload(_specs(long_outputs)),
        profile="qwen3-235b",
        engines=3,
        training_s=0.0,
        drain_bound_s=2.0,
        restart_roles=restart_roles,
    )
    policy = _SwitchAt(name="switch-at", interval_s=0.5, at_s=8.0)
    sim = Simulation(config, config.workload, load_profile(config.profile), policy)
    return SimResult(config, sim, sim.run(), 0.0).to_json()


@pytest.fixture
def decisions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, str, list[str], list[str]]]:
    """Every drain decision of the runs in the test: (time, engine, trajectories of the decodes it hands on, those
    a rule reading the true output lengths would have handed on)."""
    seen: list[tuple[float, str, list[str], list[str]]] = []
    plan = engine_switching.drain_plan

    def recording(engine, now):  # type: ignore[no-untyped-def]
        leaving = plan(engine, now)
        if engine.seqs:
            batch = len(engine.seqs)
            step_s = engine._cost.decode_step_s(batch, engine._ctx_base + batch * engine.steps_done)
            truth = [
                r.traj.spec.traj_id
                for r in engine.seqs.values()
                if not finishes_in_drain(r.target_step - engine.steps_done, step_s, engine.drain_bound_s)
            ]
            seen.append((now, engine.engine_id, sorted(r.traj.spec.traj_id for r in leaving), sorted(truth)))
        return leaving

    monkeypatch.setattr(engine_switching, "drain_plan", recording)
    return seen


# None ends before the switch at 8 s (the oldest has produced ~630 tokens by then).
LONG = [700 + 20 * (i % 5) for i in range(24)]


def test_a_restarts_drain_decision_does_not_read_true_output_lengths(decisions) -> None:
    """The same cluster at the same moment, with the unfinished answers' true lengths changed (ten times longer):
    the restarting engine keeps and moves the very same decodes — those near the length of the answers it saw
    end stay, the younger ones move — where a rule reading the true lengths would have decided otherwise."""
    _run(LONG, restart_roles=("prefill",))
    (now, engine, moved, by_truth), *_ = decisions
    decisions.clear()
    _run([10 * n for n in LONG], restart_roles=("prefill",))
    (now_long, engine_long, moved_long, by_truth_long), *_ = decisions
    assert (now_long, engine_long, moved_long) == (pytest.approx(now), engine, moved)
    assert now > 8.0 and 0 < len(moved) < 12  # after the command; some decodes stay, some move
    assert by_truth != by_truth_long  # the true lengths would have moved the decision


def test_an_in_place_switch_to_prefill_drains_nothing_and_hands_its_decodes_on_through_its_cache(
    decisions,
) -> None:
    """In place, nothing drains: the engine becoming prefill hands on the answers it decodes that the drain rule
    does not keep (a prefill engine would carry them one token per prefill step), each prefilled again from its
    own prefix cache — one token computed per move. A restart loses that cache: its moves recompute what they had
    streamed."""
    data = _run(LONG, restart_roles=())
    (_, _, moved, _), *later = decisions
    assert not later and data["role_switches"] == 1  # one decision, at the switch
    assert 0 < len(moved) == data["migrations"]
    assert data["tokens"]["migration_recompute"] == data["migrations"]
    restart = _run(LONG, restart_roles=("prefill",))
    assert restart["migrations"] > 0
    assert restart["tokens"]["migration_recompute"] > 100 * restart["migrations"]

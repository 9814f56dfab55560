"""Simulator invariants: determinism, token conservation, completion, switching and the async mode."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from prorsa.sim import SimConfig, run_simulation
from prorsa.sim import events as ev
from prorsa.sim.core import Simulation
from prorsa.sim.fixed_workload import FixedWorkload
from prorsa.sim.runner import SimResult
from prorsa.workload.types import TrajectorySpec, Turn
from services.allocator.policy import AllocatorPolicy, ClusterView, Plan
from services.runtime.model_profiles import load_profile


def _multi_turn(n: int = 24, turns: int = 4, group_size: int = 1) -> list[TrajectorySpec]:
    return [
        TrajectorySpec(
            traj_id=str(i),
            task="coding",
            group=f"g{i // group_size}",
            turns=tuple(
                Turn(
                    2_500 if k == 0 else 150 + 40 * ((i + k) % 5),
                    120 + 37 * ((i * 7 + k) % 11),
                    0.4 + 0.3 * (i % 3) if k < turns - 1 else 0.0,
                )
                for k in range(turns - i % 2)
            ),
        )
        for i in range(n)
    ]


def _expected_tokens(specs: list[TrajectorySpec], steps: int) -> tuple[int, int]:
    prompt = sum(s.context_before(k) for s in specs for k in range(len(s.turns)))
    return steps * prompt, steps * sum(s.total_output_tokens for s in specs)


@pytest.mark.parametrize("policy", ["colocated", "static:2:2", "static:1:3"])
@pytest.mark.parametrize("profile", ["qwen3-235b", "deepseek-v3.2"])
def test_tokens_are_conserved_and_every_trajectory_completes(policy, profile):
    specs = _multi_turn(group_size=4)
    config = SimConfig(
        workload=FixedWorkload(specs), profile=profile, engines=4, policy=policy, steps=2, training_s=5.0
    )
    data = run_simulation(config).to_json()
    prompt, output = _expected_tokens(specs, 2)
    tokens = data["tokens"]
    assert tokens["prompt"] == prompt
    assert tokens["prefill_computed"] + tokens["prefix_hit"] == prompt
    assert tokens["decoded"] == output
    assert tokens["migration_recompute"] == tokens["wasted_decoded"] == 0
    assert data["trajectories_completed"] == data["trajectories_expected"] == 2 * len(specs)
    assert 0 < data["prefix_cache_hit_rate"] < 1
    assert (
        data["p50_trajectory_s"] <= data["p99_trajectory_s"] <= data["max_trajectory_s"] <= data["rollout_s"]
    )


def test_colocation_caches_outputs_and_disaggregation_recomputes_them():
    specs = _multi_turn()
    new_tokens = sum(s.total_new_prompt_tokens for s in specs)
    last_outputs = sum(s.turns[-1].output_tokens for s in specs)
    outputs = sum(s.total_output_tokens for s in specs)
    coloc = run_simulation(
        SimConfig(workload=FixedWorkload(specs), engines=2, policy="colocated", training_s=0)
    )
    split = run_simulation(
        SimConfig(workload=FixedWorkload(specs), engines=2, policy="static:1:1", training_s=0)
    )
    # Mixed engines keep prompt + output: each later turn computes only its new tokens (plus the one token
    # vLLM always recomputes). A prefill engine never sees outputs: each later turn recomputes the last one.
    n_later_turns = sum(len(s.turns) - 1 for s in specs)
    assert coloc.to_json()["tokens"]["prefill_computed"] == new_tokens
    assert split.to_json()["tokens"]["prefill_computed"] == new_tokens + outputs - last_outputs
    assert n_later_turns > 0


def test_same_seed_gives_identical_json_and_a_real_workload_runs():
    config = dict(
        workload="profile:coding",
        engines=16,
        policy="static:4:12",
        batch_size=16,
        seed=3,
        duration_s=120.0,
        mode="async",
        training_s=20.0,
    )
    a = json.dumps(run_simulation(SimConfig(**config)).to_json(), sort_keys=True)
    b = json.dumps(run_simulation(SimConfig(**config)).to_json(), sort_keys=True)
    assert a == b
    c = json.dumps(run_simulation(SimConfig(**(config | {"seed": 4}))).to_json(), sort_keys=True)
    assert a != c


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, dict]] = []

    def on_event(self, kind: str, traj_id: str, now: float, **fields) -> None:
        self.events.append((kind, traj_id, now, fields))


def test_observer_sees_each_lifecycle_in_order():
    specs = _multi_turn(n=6)
    recorder = _Recorder()
    run_simulation(
        SimConfig(
            workload=FixedWorkload(specs), engines=4, policy="static:2:2", training_s=0, observer=recorder
        )
    )
    by_traj: dict[str, list[tuple[str, float]]] = {}
    for kind, traj_id, now, _ in recorder.events:
        by_traj.setdefault(traj_id, []).append((kind, now))
    assert len(by_traj) == len(specs)
    for spec in specs:
        seq = by_traj[f"s0-{spec.traj_id}"]
        kinds = [k for k, _ in seq]
        assert kinds[0] == ev.TRAJECTORY_STARTED and kinds[-1] == ev.TRAJECTORY_FINISHED
        assert kinds.count(ev.TURN_SUBMITTED) == kinds.count(ev.PREFILL_DONE) == len(spec.turns)
        assert kinds.count(ev.TOOL_CALL_START) == kinds.count(ev.TOOL_CALL_END) == len(spec.turns) - 1
        assert ev.DECODE_PROGRESS in kinds
        assert [t for _, t in seq] == sorted(t for _, t in seq)


@dataclass
class _Rotate(AllocatorPolicy):
    """Test policy: rotates every engine through prefill → decode → mixed every `period_s`."""

    period_s: float = 20.0

    def initial_plan(self, engine_ids):
        return Plan({e: ("prefill" if i < 2 else "decode") for i, e in enumerate(sorted(engine_ids))})

    def plan(self, view: ClusterView):
        k = int(view.now / self.period_s)
        roles = ("prefill", "decode", "mixed")
        return Plan({e.engine_id: roles[(i + k) % 3] for i, e in enumerate(view.engines)}, reason="rotate")


@pytest.mark.parametrize("restart_roles", [(), ("prefill", "decode", "mixed")])
def test_role_switches_conserve_tokens_in_place_and_across_restarts(restart_roles: tuple[str, ...]) -> None:
    """In place (one layout, the default) only a switch to prefill moves anything: its long decodes, each prefilled
    again from the engine's own cache, one token recomputed. Where every role has its own layout each switch
    restarts the engine: long decodes migrate and their streamed tokens are recomputed. Either way every prompt and
    output token is accounted for exactly once."""
    specs = _multi_turn(n=16, turns=5)
    config = SimConfig(
        workload=FixedWorkload(specs),
        profile="qwen3-235b",
        engines=4,
        steps=2,
        training_s=3.0,
        drain_bound_s=0.5,
        restart_roles=restart_roles,
    )
    sim = Simulation(
        config, config.workload, load_profile(config.profile), _Rotate(name="rotate", interval_s=4.0)
    )
    data = SimResult(config, sim, sim.run(), 0.0).to_json()
    prompt, output = _expected_tokens(specs, 2)
    tokens = data["tokens"]
    assert data["role_switches"] > 4
    if restart_roles:
        assert data["migrations"] > 0 and tokens["migration_recompute"] > 0
    else:
        assert data["migrations"] > 0 and tokens["migration_recompute"] == data["migrations"]
    assert tokens["prompt"] == prompt and tokens["prefill_computed"] + tokens["prefix_hit"] == prompt
    assert tokens["decoded"] == output
    assert data["trajectories_completed"] == 2 * len(specs)
    assert data["windows"]["engines"]["switching"] and max(data["windows"]["engines"]["switching"]) > 0


def test_async_overlaps_training_and_staleness_zero_aborts():
    specs = _multi_turn(n=12)
    # Training (10 s) shorter than a step's rollout: the next step's trajectories are mid-way when weights update,
    # so with staleness 0 those that submit a turn afterwards restart.
    base = dict(workload=FixedWorkload(specs), engines=4, policy="colocated", steps=3, training_s=10.0)
    sync = run_simulation(SimConfig(mode="sync", **base)).to_json()
    relaxed = run_simulation(SimConfig(mode="async", staleness=1, **base)).to_json()
    strict = run_simulation(SimConfig(mode="async", staleness=0, **base)).to_json()
    assert relaxed["rollout_s"] < sync["rollout_s"]  # generation of step i+1 overlaps training of step i
    assert relaxed["trajectories_aborted"] == 0 and sync["trajectories_aborted"] == 0
    assert strict["trajectories_aborted"] > 0
    for data in (sync, relaxed, strict):
        assert data["steps_trained"] == 3
        assert data["trajectories_completed"] == data["trajectories_expected"] == 36
    _, output = _expected_tokens(specs, 3)
    assert strict["tokens"]["decoded"] == output + strict["tokens"]["wasted_decoded"]
    assert strict["tokens"]["wasted_decoded"] > 0


def test_duration_caps_virtual_time():
    data = run_simulation(
        SimConfig(workload=FixedWorkload(_multi_turn()), engines=2, duration_s=5.0, mode="async")
    ).to_json()
    assert data["rollout_s"] == 5.0
    assert data["trajectories_completed"] < data["trajectories_expected"]
    assert len(data["windows"]["t_s"]) == 1


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError):
        SimConfig(mode="semi")
    with pytest.raises(ValueError):
        SimConfig(engines=0)
    with pytest.raises(ValueError):
        run_simulation(SimConfig(workload=FixedWorkload(_multi_turn()), engines=4, policy="static:3:2"))


def test_a_trajectory_whose_context_outgrows_the_model_ends_there():
    """As the live driver does when an engine rejects the prompt: turns 0-1 run, turn 2's prompt (3,000 + 100 +
    1,500 tokens > 4,000) ends the trajectory after its tool call; the other trajectory runs every turn."""
    long_ = TrajectorySpec(
        "long", "coding", (Turn(3_000, 100, 1.0), Turn(500, 100, 2.0), Turn(1_500, 50, 0.0))
    )
    short = TrajectorySpec("short", "coding", (Turn(500, 100, 1.0), Turn(200, 50, 0.0)))
    recorder = _Recorder()
    data = run_simulation(
        SimConfig(
            workload=FixedWorkload([long_, short]),
            engines=2,
            policy="colocated",
            training_s=0,
            max_model_len=4_000,
            observer=recorder,
        )
    ).to_json()
    assert data["trajectories_completed"] == data["trajectories_expected"] == 2
    assert data["trajectories_truncated"] == 1
    submitted = [f["turn"] for k, t, _, f in recorder.events if k == ev.TURN_SUBMITTED and t == "s0-long"]
    assert submitted == [0, 1]
    finished = {t: (now, f["turns"]) for k, t, now, f in recorder.events if k == ev.TRAJECTORY_FINISHED}
    tool_end = max(now for k, t, now, _ in recorder.events if k == ev.TOOL_CALL_END and t == "s0-long")
    assert finished["s0-long"] == (tool_end, 2) and finished["s0-short"][1] == 2

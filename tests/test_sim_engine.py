"""Engine stepping against the performance model: decode jumps, admissions mid-jump, prefill chunking."""

from __future__ import annotations

import pytest

from prorsa.sim import SimConfig, run_simulation
from prorsa.sim import events as ev
from prorsa.sim.fixed_workload import FixedWorkload
from prorsa.workload.types import TrajectorySpec, Turn
from services.runtime import perf_model as pm
from services.runtime.model_profiles import BUILTIN_PROFILES


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, dict]] = []

    def on_event(self, kind: str, traj_id: str, now: float, **fields) -> None:
        self.events.append((kind, traj_id, now, fields))

    def first(self, kind: str, traj_id: str) -> float:
        return next(t for k, tid, t, _ in self.events if k == kind and tid == traj_id)


def _run(specs, policy: str, profile: str = "qwen3-235b", engines: int = 2) -> tuple[dict, _Recorder]:
    rec = _Recorder()
    config = SimConfig(
        workload=FixedWorkload(specs),
        profile=profile,
        engines=engines,
        policy=policy,
        training_s=0.0,
        observer=rec,
    )
    return run_simulation(config).to_json(), rec


def test_a_lone_decode_takes_the_sum_of_its_step_times():
    p = BUILTIN_PROFILES["qwen3-235b"]
    prompt, out = 1_000, 500
    _, rec = _run([TrajectorySpec(traj_id="a", task="t", turns=(Turn(prompt, out, 0.0),))], "static:1:1")
    start = rec.first(ev.DECODE_STARTED, "s0-a")
    end = rec.first(ev.TRAJECTORY_FINISHED, "s0-a")
    # The prefill sampled the first token; the other out - 1 are one step each, the context growing from prompt + 1.
    expected = sum(pm.decode_step_time_s(p, 1, prompt + 1 + i) for i in range(out - 1))
    assert end - start == pytest.approx(expected, rel=1e-9)
    # Prefill then KV transfer came first.
    prefill_done = rec.first(ev.PREFILL_DONE, "s0-a")
    assert prefill_done == pytest.approx(pm.prefill_time_s(p, prompt, 0))
    assert start == pytest.approx(prefill_done + pm.kv_transfer_time_s(p, prompt))


def test_a_handoff_arriving_mid_jump_joins_at_the_next_step_boundary():
    p = BUILTIN_PROFILES["qwen3-235b"]
    specs = [
        TrajectorySpec(traj_id="long", task="t", turns=(Turn(100, 5_000, 0.0),)),
        TrajectorySpec(traj_id="late", task="t", turns=(Turn(100, 50, 0.0),), arrival_s=7.3),
    ]
    _, rec = _run(specs, "static:1:1")
    arrived = rec.first(ev.PREFILL_DONE, "s0-late") + pm.kv_transfer_time_s(p, 100)
    joined = rec.first(ev.DECODE_STARTED, "s0-late")
    assert arrived <= joined <= arrived + pm.decode_step_time_s(p, 1, 100 + 5_000) + 1e-9
    # The long one still finishes after exactly 4,999 steps: batch 2 for 49 of them.
    long_start = rec.first(ev.DECODE_STARTED, "s0-long")
    long_end = rec.first(ev.TRAJECTORY_FINISHED, "s0-long")
    solo = sum(pm.decode_step_time_s(p, 1, 101 + i) for i in range(4_999))
    assert solo < long_end - long_start < solo + 50 * (pm.decode_step_time_s(p, 2, 20_000) - 0.008)


def test_long_prompts_are_chunked_over_prefill_steps():
    p = BUILTIN_PROFILES["qwen3-235b"]
    prompt = 3 * p.prefill_batch_tokens + 100
    _, rec = _run([TrajectorySpec(traj_id="a", task="t", turns=(Turn(prompt, 5, 0.0),))], "static:1:1")
    done = rec.first(ev.PREFILL_DONE, "s0-a")
    b = p.prefill_batch_tokens
    chunks = [(b, 0), (b, b), (b, 2 * b), (100, 3 * b)]
    expected = sum(pm.prefill_time_s(p, n, c) for n, c in chunks)
    assert done == pytest.approx(expected)


def test_colocated_decodes_slow_down_while_prompts_are_chunked_in():
    # One engine, one long decode, then a burst of prompts: the decode's steps are mixed steps while they last.
    specs = [TrajectorySpec(traj_id="d", task="t", turns=(Turn(100, 2_000, 0.0),))] + [
        TrajectorySpec(traj_id=f"p{i}", task="t", turns=(Turn(16_000, 5, 0.0),), arrival_s=1.0)
        for i in range(8)
    ]
    alone, _ = _run(specs[:1], "colocated", profile="deepseek-v3.2", engines=1)
    mixed, _ = _run(specs, "colocated", profile="deepseek-v3.2", engines=1)
    # 8 prompts of 16K on 8 DP ranks: ⌈16,000 / 2,048⌉ = 8 mixed steps, each stalled by a 2,048-token rank chunk.
    p = BUILTIN_PROFILES["deepseek-v3.2"]
    stall = pm.mixed_step_time_s(p, 8 * 2_048, 1, 2_000) - pm.decode_step_time_s(p, 1, 2_000)
    assert stall > 0.3
    assert mixed["max_trajectory_s"] > alone["max_trajectory_s"] + 7 * stall


def test_an_engine_that_becomes_prefill_never_takes_waiting_handoffs():
    """Regression: with no decode engine, handoffs wait for a mixed one; a prefill engine rejoining then must
    leave them (it would hold decodes it never steps, and the run would never end)."""
    from prorsa.sim.core import Simulation
    from prorsa.sim.state import Request, Traj
    from services.allocator.registry import make_policy

    specs = [TrajectorySpec("t0", "coding", (Turn(1000, 50, 0.0),))]
    profile = BUILTIN_PROFILES["qwen3-235b"]
    config = SimConfig(workload=FixedWorkload(specs), engines=2, policy="static:1:0:1", training_s=0.0)
    sim = Simulation(config, FixedWorkload(specs), profile, make_policy("static:1:0:1", 2), observer=None)
    prefill = next(e for e in sim.engines.values() if e.role == "prefill")
    mixed = next(e for e in sim.engines.values() if e.role == "mixed")
    sim.router.engine_leaving(mixed, 0.0)  # no engine can decode: a handoff waits
    traj = Traj(specs[0], step=0, attempt=0, version=0, key="t0", group_key="", group_tokens=0)
    req = Request(sim.driver.new_rid(), traj, 0, 1000, 50)  # nobody may take it
    sim.router.handoffs.append(req)
    sim.router.engine_available(prefill, 0.0)
    assert prefill.incoming == 0 and not prefill.seqs and list(sim.router.handoffs) == [req]

"""The simulator's placement is the live one: shared queues that engines pull from by capacity, engines with room
taking turns, prefix affinity by the client's rule, and a mixed engine's handoff checks (`prorsa.sim.router`)."""

from __future__ import annotations

import pytest

from prorsa.client.directory import EngineDirectory
from prorsa.sim import SimConfig, run_simulation
from prorsa.sim import events as ev
from prorsa.sim.fixed_workload import FixedWorkload
from prorsa.sim.router import held_work
from prorsa.workload.types import TrajectorySpec, Turn
from proto import EngineStats
from services.engine_agent.pull_capacity import PullConfig
from services.runtime import perf_model as pm
from services.runtime.model_profiles import BUILTIN_PROFILES

PROFILE = "qwen3-235b"


class _Engines:
    """Which engine prefilled and which decoded each turn (lifecycle events)."""

    def __init__(self) -> None:
        self.prefill: dict[tuple[str, int], str] = {}
        self.decode: dict[tuple[str, int], tuple[str, float]] = {}

    def on_event(self, kind: str, traj_id: str, now: float, **fields: object) -> None:
        if kind == ev.PREFILL_DONE:
            self.prefill[(traj_id, fields["turn"])] = fields["engine_id"]  # type: ignore[index]
        elif kind == ev.DECODE_STARTED:
            self.decode[(traj_id, fields["turn"])] = (fields["engine_id"], now)  # type: ignore[index]


def _run(specs: list[TrajectorySpec], policy: str, engines: int, duration_s: float | None = None):
    seen = _Engines()
    config = SimConfig(
        workload=FixedWorkload(specs),
        engines=engines,
        policy=policy,
        profile=PROFILE,
        training_s=0.0,
        duration_s=duration_s,
        observer=seen,
    )
    return run_simulation(config), seen


def _burst(n: int, prompt: int, out: int = 50) -> list[TrajectorySpec]:
    return [TrajectorySpec(f"t{i}", "t", (Turn(prompt, out, 0.0),)) for i in range(n)]


def test_engines_with_room_take_turns_at_the_shared_queue():
    # Six prompts at once, three idle mixed engines: each fetch takes one message and queues again at the back, so
    # the engines take two each (a least-loaded scheduler could do the same; a greedy first engine would take all).
    result, _ = _run(_burst(6, 2_000), "colocated", engines=3, duration_s=1e-6)
    held = [held_work(e).prefill_jobs for e in result.sim.engines.values()]
    assert held == [2, 2, 2]
    assert not result.sim.router.prompts


def test_a_prefill_engine_holds_prompts_up_to_its_token_budget_and_the_rest_waits_shared():
    budget = PullConfig().prefill_budget_tokens
    prompt = budget * 5 // 8  # one fits under the budget, a second pull overshoots it, a third may not start
    result, seen = _run(_burst(4, prompt), "static:1:1", engines=2, duration_s=1e-6)
    prefill = result.sim.engines["engine-0"]
    assert prefill.role == "prefill"
    assert held_work(prefill).prefill_jobs == 2
    assert len(result.sim.router.prompts) == 2  # waiting in the shared queue, not on an engine
    # Run to the end: the waiting prompts are pulled as the budget frees, and every turn completes.
    result, seen = _run(_burst(4, prompt), "static:1:1", engines=2)
    assert result.to_json()["trajectories_completed"] == 4
    assert set(seen.prefill.values()) == {"engine-0"}


def test_a_next_turn_goes_back_to_the_engine_that_prefilled_the_last_one():
    specs = [
        TrajectorySpec(f"t{i}", "t", (Turn(3_000, 40, 1.0), Turn(500, 40, 1.0), Turn(500, 40, 0.0)))
        for i in range(4)
    ]
    result, seen = _run(specs, "colocated", engines=4)
    for i in range(4):
        engines = {seen.prefill[(f"s0-t{i}", k)] for k in range(3)}
        assert len(engines) == 1, f"t{i} moved: {engines}"
    assert len({seen.prefill[(f"s0-t{i}", 0)] for i in range(4)}) == 4  # the first turns spread out
    assert result.sim.router.affinity_hits == 8 and result.sim.router.affinity_misses == 0


def test_the_affinity_check_is_the_clients():
    directory = EngineDirectory()

    def stats(role: str, waiting: int, switching: bool = False) -> EngineStats:
        return EngineStats(
            engine_id="e",
            ts_s=0.0,
            role=role,
            epoch=0,
            waiting=waiting,
            switching=switching,  # type: ignore[arg-type]
        )

    assert directory.accepts(stats("prefill", directory.max_waiting))
    assert directory.accepts(stats("mixed", 0))
    assert not directory.accepts(stats("prefill", directory.max_waiting + 1))  # a long queue: go shared
    assert not directory.accepts(stats("decode", 0))
    assert not directory.accepts(stats("mixed", 0, switching=True))
    # What waits for it on the bus, addressed and not pulled, counts as much as what it pulled.
    backlog = EngineStats(engine_id="e", ts_s=0.0, role="prefill", epoch=0, waiting=1, addressed_waiting=8)
    assert not directory.accepts(backlog)
    # A long context is worth waiting for: recomputing 60k tokens elsewhere costs 25 prompts of its 2.4k new ones.
    assert directory.accepts(backlog, worth_prompts=60_000 / 2_400)
    assert not directory.accepts(stats("prefill", 26), worth_prompts=60_000 / 2_400)


def test_decode_engines_with_room_take_handoffs_in_turn():
    result, seen = _run(_burst(4, 1_000, out=400), "static:1:2", engines=3)
    decoders = [seen.decode[(f"s0-t{i}", 0)][0] for i in range(4)]
    assert sorted(decoders) == ["engine-1", "engine-1", "engine-2", "engine-2"]


def test_a_mixed_engine_holding_no_prompt_looks_at_handoffs_every_check_interval():
    # A prefill and a mixed engine, one turn: the prefill engine pulls it first (its fetch waits longest) and
    # hands it off at once; the mixed engine looked at the handoff queue when it joined, found nothing, and looks
    # again decode_check_s later.
    p = BUILTIN_PROFILES[PROFILE]
    result, seen = _run(_burst(1, 1_000), "static:1:0:1", engines=2)
    assert seen.prefill[("s0-t0", 0)] == "engine-0"
    engine, started = seen.decode[("s0-t0", 0)]
    assert engine == "engine-1" and result.sim.engines["engine-1"].role == "mixed"
    check = PullConfig().decode_check_s
    assert started == pytest.approx(check + pm.kv_transfer_time_s(p, 1_000))


def test_the_policy_sees_what_the_live_allocator_would_estimate():
    # The view is the live allocator's `build_view` on the engines' stats and the WORK stream's depth: two prompts
    # pulled by the prefill engine (their whole contexts in flight) and two waiting in the shared queue (counted at
    # the recent mean prompt: the one prefill started, 20,480 tokens).
    prompt = 20_480
    result, _ = _run(_burst(4, prompt), "static:1:1", engines=2, duration_s=1e-6)
    view = result.sim.cluster_view(1e-6)
    prefill = next(v for v in view.engines if v.role == "prefill")
    assert prefill.queued_prefill_tokens == prefill.in_flight_tokens == 2 * prompt
    assert view.recent_mean_isl_tokens == prompt
    assert view.prefill_queue_tokens == 4 * prompt
    assert view.decode_queue_len == 0

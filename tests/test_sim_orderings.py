"""Orderings the simulator must reproduce: when colocation wins, when disaggregation wins, and the demand drift."""

from __future__ import annotations

import statistics

from prorsa.sim import SimConfig, run_simulation
from prorsa.sim.fixed_workload import FixedWorkload
from prorsa.workload.types import TrajectorySpec, Turn


def _run(specs: list[TrajectorySpec], profile: str, policy: str) -> dict:
    config = SimConfig(
        workload=FixedWorkload(specs), profile=profile, engines=4, policy=policy, training_s=0.0
    )
    return run_simulation(config).to_json()


def test_decode_only_workload_colocation_beats_a_split_that_starves_decode():
    # One turn, tiny prompts, long outputs: a 3:1 split leaves three engines idle and one decoding everything.
    specs = [
        TrajectorySpec(traj_id=str(i), task="math", turns=(Turn(50, 4_000 + 50 * i, 0.0),)) for i in range(64)
    ]
    coloc = _run(specs, "qwen3-235b", "colocated")
    split = _run(specs, "qwen3-235b", "static:3:1")
    assert coloc["rollout_s"] < 0.85 * split["rollout_s"]
    assert coloc["avg_trajectory_s"] < split["avg_trajectory_s"]
    assert split["utilisation"]["prefill"] < 0.05 < 0.9 < split["utilisation"]["decode"]


def test_prefill_heavy_multi_turn_with_dp_attention_disaggregation_beats_colocation():
    # Long new observations every turn, short answers: with DP attention a mixed engine's prefill chunk stalls
    # the decode step of every rank, so colocated decodes crawl while prompts keep arriving.
    specs = [
        TrajectorySpec(
            traj_id=str(i),
            task="general",
            turns=tuple(
                Turn(8_000 if k == 0 else 3_000, 100 + 7 * (i % 5), 0.5 if k < 9 else 0.0) for k in range(10)
            ),
        )
        for i in range(64)
    ]
    coloc = _run(specs, "deepseek-v3.2", "colocated")
    split = _run(specs, "deepseek-v3.2", "static:3:1")
    assert split["rollout_s"] < 0.85 * coloc["rollout_s"]
    assert split["avg_trajectory_s"] < 0.85 * coloc["avg_trajectory_s"]
    # The same workload on a TP engine (no rank stall) leaves colocation competitive.
    tp_coloc = _run(specs, "qwen3-235b", "colocated")
    tp_split = _run(specs, "qwen3-235b", "static:3:1")
    assert tp_coloc["rollout_s"] < 1.1 * tp_split["rollout_s"]


def test_prefill_decode_ratio_drifts_within_a_sync_step():
    # DESIGN.md: on the SWE trace the new-prefill : decode ratio starts high (first prompts), settles, and falls
    # in the long tail.
    data = run_simulation(
        SimConfig(workload="swe", batch_size=64, engines=16, policy="colocated", training_s=0.0)
    ).to_json()
    ratios = [r for r in data["windows"]["prefill_decode_ratio"] if r is not None]
    n = len(ratios)
    assert n >= 20
    middle = statistics.median(ratios[n // 3 : 2 * n // 3])
    tail = statistics.median(ratios[2 * n // 3 :])
    assert ratios[0] > 4 * middle
    assert tail < middle

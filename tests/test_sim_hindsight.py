"""The hindsight oracle: forks are independent copies, and the search never ends behind the obvious choices."""

from __future__ import annotations

import dataclasses

import pytest

from prorsa.bench.compare import compare_policies
from prorsa.sim.core import Simulation
from prorsa.sim.hindsight import HindsightOracle, candidates
from prorsa.sim.runner import SimConfig, _load_workload, run_simulation
from services.allocator.policies.common import Split
from services.allocator.registry import make_policy
from services.runtime.model_profiles import load_profile


def _fresh(config: SimConfig) -> Simulation:
    profile = load_profile(config.profile)
    policy = make_policy(config.policy, config.engines, profile=profile)
    return Simulation(config, _load_workload(config), profile, policy)


def test_a_fork_runs_on_its_own_and_matches_the_run_it_was_copied_from() -> None:
    config = SimConfig(
        workload="profile:general",
        profile="deepseek-v3.2",
        engines=4,
        batch_size=16,
        steps=1,
        policy="static:1:3",
    )
    whole = run_simulation(config).to_json()
    sim = _fresh(config)
    sim.driver.start(0.0)
    sim.advance(40.0)
    fork = sim.fork(make_policy("static:1:3", 4))
    before = sim.metrics.turns_finished
    fork.advance(1e9)  # the fork runs to its end...
    assert sim.metrics.turns_finished == before  # ...and the original has not moved
    assert fork.metrics.completion.mean() == pytest.approx(whole["avg_trajectory_s"])
    sim.advance(1e9)
    assert sim.metrics.completion.mean() == pytest.approx(whole["avg_trajectory_s"])


def test_candidates_keep_the_current_split_and_colocation() -> None:
    assert Split(0, 0, 8) in candidates(8, Split(3, 5)) and len(candidates(8, Split(3, 5))) == 8
    many = candidates(64, Split(20, 44))
    assert Split(20, 44) in many and Split(0, 0, 64) in many and len(many) == 6


@pytest.mark.parametrize(
    ("workload", "profile"),
    [("profile:general", "deepseek-v3.2"), ("profile:math", "qwen3-235b")],
)
def test_oracle_is_never_behind_static_best_or_colocated(workload: str, profile: str) -> None:
    base = SimConfig(workload=workload, profile=profile, engines=4, batch_size=16, steps=2, seed=1)
    rows, full = compare_policies(base, ["colocated", "static:best", "oracle"])
    by = {r["policy"]: r["avg_trajectory_s"] for r in rows}
    assert by["oracle"] <= min(by["colocated"], by["static:best"]) * 1.01
    assert full["oracle"]["oracle"]["forks"] > 0


def test_oracle_refuses_to_run_live() -> None:
    from services.allocator.policy import PolicyError

    spec = make_policy("oracle", 4)
    with pytest.raises(PolicyError, match="simulator only"):
        spec.plan(None)  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="simulator only"):
        HindsightOracle().plan(None)  # type: ignore[arg-type]


def test_oracle_is_deterministic() -> None:
    config = SimConfig(
        workload="profile:math", profile="deepseek-v3.2", engines=3, batch_size=8, steps=1, policy="oracle"
    )
    assert run_simulation(config).to_json() == run_simulation(dataclasses.replace(config)).to_json()

"""`oracle` in the simulator: passes fed the previous pass's realised demand, deterministic, a bench row."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from prorsa.bench.compare import compare_policies
from prorsa.sim import cli
from prorsa.sim.oracle import DemandRecord, first_pass_spec
from prorsa.sim.runner import SimConfig, run_simulation

SMALL = SimConfig(
    workload="profile:math", engines=3, batch_size=8, seed=3, policy="oracle", forecaster="lifecycle"
)


def _events(record: DemandRecord, rows: list[tuple[str, str, float, dict[str, Any]]]) -> None:
    for kind, traj, t, fields in rows:
        record.on_event(kind, traj, t, attempt=0, **fields)


def test_the_record_turns_events_into_the_truth_over_each_horizon() -> None:
    record = DemandRecord()
    _events(
        record,
        [
            ("turn_submitted", "a", 1.0, {"turn": 0, "context_tokens": 100, "new_tokens": 100}),
            ("decode_started", "a", 2.0, {"turn": 0, "output_tokens": 40}),
            ("turn_submitted", "b", 3.0, {"turn": 0, "context_tokens": 50, "new_tokens": 50}),
            ("decode_progress", "a", 4.0, {"turn": 0, "tokens": 20, "of": 40}),
            ("decode_progress", "a", 6.0, {"turn": 0, "tokens": 40, "of": 40}),
            ("tool_call_start", "a", 6.0, {"turn": 0, "latency_s": 1.0}),
            ("trajectory_aborted", "b", 7.0, {"reason": "stale"}),
            ("decode_started", "b", 8.0, {"turn": 0, "output_tokens": 10}),  # an aborted attempt: not demand
            ("decode_progress", "b", 9.0, {"turn": 0, "tokens": 10, "of": 10}),
        ],
    )
    truth = record.truth(end_s=10.0, grid_s=5.0, horizons_s=(5.0, 10.0))
    h5, h10 = truth.forecast(0.0).horizons
    assert h5.prefill_tokens.q50 == 150 and h5.prefill_tokens.q10 == h5.prefill_tokens.q90 == 150
    assert h5.decode_tokens.q50 == pytest.approx(30.0)  # 20 over (2, 4], half of 20 over (4, 6]
    assert h5.decode_concurrency.q50 == pytest.approx(3.0 / 5.0)  # one sequence over (2, 5]
    assert h10.decode_tokens.q50 == pytest.approx(40.0) and h10.decode_concurrency.q50 == pytest.approx(0.4)
    later = truth.forecast(5.0).horizons[0]
    assert later.prefill_tokens.q50 == 0 and later.decode_tokens.q50 == pytest.approx(10.0)


def test_the_record_samples_kv_at_decisions() -> None:
    record = DemandRecord()
    record.sample(5.0, [])
    record.kv_t.append(10.0)
    record.kv_tokens.append(1234.0)
    truth = record.truth(end_s=20.0, grid_s=5.0, horizons_s=(5.0,))
    assert truth.forecast(5.0).horizons[0].kv_tokens.q50 == 1234.0  # the KV at t + h
    assert truth.forecast(0.0).horizons[0].kv_tokens.q50 == 0.0
    assert truth.forecast(16.0).horizons[0].kv_tokens.q50 == 0.0  # past the recorded run's end


@pytest.fixture(scope="module")
def oracle_json() -> dict[str, Any]:
    return run_simulation(SMALL).to_json()


def test_oracle_runs_as_deterministic_passes_and_keeps_the_best(oracle_json: dict[str, Any]) -> None:
    data = oracle_json
    assert run_simulation(SMALL).to_json() == data
    passes = data["oracle"]["passes"]
    assert passes[0]["policy"] == "prorsa" and 2 <= len(passes) <= 3
    assert all(p["policy"] == "oracle" for p in passes[1:])
    assert data["rollout_s"] == min(p["rollout_s"] for p in passes[1:])
    assert passes[data["oracle"]["chosen_pass"] - 1]["rollout_s"] == data["rollout_s"]
    assert data["config"]["policy"] == "oracle" and data["trajectories_completed"] == SMALL.batch_size


def test_a_users_observer_sees_the_chosen_pass(oracle_json: dict[str, Any]) -> None:
    class Count:
        events = 0

        def on_event(self, kind: str, traj_id: str, now: float, **f: Any) -> None:
            Count.events += 1

    watched = run_simulation(dataclasses.replace(SMALL, observer=Count()))
    assert Count.events > 0
    assert watched.to_json() == oracle_json


def test_the_bench_row_of_oracle_is_a_result_and_reuses_the_prorsa_run(oracle_json: dict[str, Any]) -> None:
    base = dataclasses.replace(SMALL, policy="colocated")
    rows, full = compare_policies(base, ["prorsa", "oracle"])
    by = {r["policy"]: r for r in rows}
    assert "error" not in by["oracle"] and by["oracle"]["trajectories_completed"] == SMALL.batch_size
    # Pass 1 is exactly the prorsa run, and the bench's oracle is the plain entry point's.
    assert oracle_json["oracle"]["passes"][0]["rollout_s"] == by["prorsa"]["rollout_s"]
    # (the bench keeps each run's timelines too, for its report)
    assert {k: v for k, v in full["oracle"].items() if k != "timelines"} == oracle_json
    assert full["oracle"]["timelines"]["forecasts"]  # the oracle's decisions read the truth as forecasts
    assert first_pass_spec("oracle:margin=0.2") == "prorsa:margin=0.2"


def test_prorsa_sim_cli_runs_oracle(tmp_path, oracle_json: dict[str, Any]) -> None:
    out = tmp_path / "oracle.json"
    argv = ["--workload", "profile:math", "--engines", "3", "--batch-size", "8", "--seed", "3"]
    argv += ["--policy", "oracle", "--forecaster", "lifecycle", "--json", str(out)]
    assert cli.main(argv) == 0
    assert json.loads(out.read_text())["oracle"] == oracle_json["oracle"]

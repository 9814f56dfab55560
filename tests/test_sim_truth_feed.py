"""A policy fed the true future demand (`--forecaster truth`): passes fed the previous pass's realised demand."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from prorsa.bench.compare import compare_policies
from prorsa.sim import cli
from prorsa.sim.runner import SimConfig, run_simulation
from prorsa.sim.truth_feed import DemandRecord

SMALL = SimConfig(
    workload="profile:math", engines=3, batch_size=8, seed=3, policy="prorsa", forecaster="truth"
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


def test_the_truth_outlook_is_this_runs_present_and_the_recorded_runs_turns_ahead() -> None:
    """The outlook a truth-fed pass reads: the live trajectories by phase and the starts of the pass itself, the
    turns, tool calls and finishes of the recorded pass over (now, now + the shortest horizon]."""
    recorded = DemandRecord()
    _events(
        recorded,
        [
            ("trajectory_started", "a", 0.0, {"task": "general", "step": 0}),
            ("turn_submitted", "a", 0.0, {"turn": 0, "context_tokens": 1000, "new_tokens": 1000}),
            ("decode_started", "a", 1.0, {"turn": 0, "output_tokens": 50}),
            ("tool_call_start", "a", 2.0, {"turn": 0, "latency_s": 2.0}),
            ("turn_submitted", "a", 4.0, {"turn": 1, "context_tokens": 1150, "new_tokens": 100}),
            ("request_migrated", "a", 4.5, {"turn": 1, "decoded_tokens": 0}),
            ("decode_started", "a", 5.0, {"turn": 1, "output_tokens": 70}),
            (
                "decode_started",
                "a",
                5.5,
                {"turn": 1, "output_tokens": 60},
            ),  # after a migration: the rest only
            ("trajectory_started", "b", 1.0, {"task": "math", "step": 0}),
            ("turn_submitted", "b", 1.0, {"turn": 0, "context_tokens": 300, "new_tokens": 300}),
            ("decode_started", "b", 1.5, {"turn": 0, "output_tokens": 10}),
            ("trajectory_finished", "b", 3.0, {"turns": 1, "completion_s": 2.0}),
        ],
    )
    truth = recorded.truth(end_s=10.0, grid_s=1.0, horizons_s=(5.0, 10.0))
    present = DemandRecord()  # the running pass, 0.5 s in: "a" decoding, "b" waiting for its prefill
    _events(
        present,
        [
            ("trajectory_started", "a", 0.0, {"task": "general", "step": 0}),
            ("turn_submitted", "a", 0.0, {"turn": 0, "context_tokens": 1000, "new_tokens": 1000}),
            ("decode_started", "a", 0.4, {"turn": 0, "output_tokens": 50}),
            ("trajectory_started", "b", 0.5, {"task": "math", "step": 0}),
            ("turn_submitted", "b", 0.5, {"turn": 0, "context_tokens": 300, "new_tokens": 300}),
        ],
    )
    fc = truth.forecast(0.5, present.present)
    assert fc.outlook_horizon_s == 5.0 and fc.started_total == 2
    general, math = fc.outlook
    assert (general.task, general.decode, general.live) == ("general", 1, 1)
    assert (math.task, math.prefill, math.live) == ("math", 1, 1)
    # general over (0.5, 5.5]: its second turn (100 new tokens, a 1,150-token context, 70 output tokens: the
    # first decode's), the tool call of 2 s before it; nobody finishes
    assert general.turns.mean == general.turns.q10 == general.turns.q90 == 1.0
    assert general.new_tokens.mean == 100.0 and general.context_tokens.mean == 1150.0
    assert general.output_tokens.mean == 70.0 and general.tool_s.mean == 2.0 and general.tool_s.observed == 1
    assert general.finished.mean == 0.0
    # math: its first turn at 1.0 and the trajectory's end at 3.0 fall within; no tool call
    assert (math.turns.mean, math.finished.mean, math.output_tokens.mean) == (1.0, 1.0, 10.0)
    assert math.tool_s.observed == 0
    # later, past the recorded turns: a live task with nothing ahead
    late = truth.forecast(6.0, present.present).outlook[0]
    assert late.turns.mean == 0.0 and late.context_tokens.observed == 0
    # the present follows the pass: "a" into a tool call, "b" finished
    _events(present, [("tool_call_start", "a", 2.0, {"turn": 0, "latency_s": 2.0})])
    _events(present, [("trajectory_finished", "b", 3.0, {"turns": 1, "completion_s": 2.5})])
    (only,) = truth.forecast(3.0, present.present).outlook
    assert (only.task, only.tool_call, only.live) == ("general", 1, 1)


@pytest.fixture(scope="module")
def truth_json() -> dict[str, Any]:
    return run_simulation(SMALL).to_json()


def test_truth_fed_runs_as_deterministic_passes_and_keeps_the_best(truth_json: dict[str, Any]) -> None:
    data = truth_json
    assert run_simulation(SMALL).to_json() == data
    passes = data["truth_passes"]["passes"]
    assert 2 <= len(passes) <= 3 and all(p["policy"] == "prorsa" for p in passes)
    assert data["rollout_s"] == min(p["rollout_s"] for p in passes[1:])
    assert passes[data["truth_passes"]["chosen_pass"] - 1]["rollout_s"] == data["rollout_s"]
    assert data["config"]["forecaster"] == "truth" and data["trajectories_completed"] == SMALL.batch_size


def test_a_users_observer_sees_the_chosen_pass(truth_json: dict[str, Any]) -> None:
    class Count:
        events = 0

        def on_event(self, kind: str, traj_id: str, now: float, **f: Any) -> None:
            Count.events += 1

    watched = run_simulation(dataclasses.replace(SMALL, observer=Count()))
    assert Count.events > 0
    assert watched.to_json() == truth_json


def test_the_bench_runs_a_policy_with_another_forecaster(truth_json: dict[str, Any]) -> None:
    base = dataclasses.replace(SMALL, forecaster="lifecycle")
    rows, full = compare_policies(base, ["prorsa@truth", "prorsa@naive"])
    by = {r["policy"]: r for r in rows}
    assert by["prorsa@truth"]["avg_trajectory_s"] == truth_json["avg_trajectory_s"]
    assert full["prorsa@naive"]["config"]["forecaster"] == "naive"
    assert full["prorsa@truth"]["timelines"][
        "forecasts"
    ]  # the bench keeps each run's timelines for its report


def test_prorsa_sim_cli_runs_truth_fed(tmp_path, truth_json: dict[str, Any]) -> None:
    out = tmp_path / "truth.json"
    argv = ["--workload", "profile:math", "--engines", "3", "--batch-size", "8", "--seed", "3"]
    argv += ["--policy", "prorsa", "--forecaster", "truth", "--json", str(out)]
    assert cli.main(argv) == 0
    assert json.loads(out.read_text())["truth_passes"] == truth_json["truth_passes"]

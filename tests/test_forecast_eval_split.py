"""Held-out halves of a workload, and the allocator value of a predictor (naive, the predictor, the truth)."""

from __future__ import annotations

import pytest

from prorsa.forecast_eval.split import half, split_workload
from prorsa.forecast_eval.value import predictor_value
from prorsa.sim.runner import SimConfig
from prorsa.workload.errors import WorkloadError
from prorsa.workload.spec import _source


def _instance(traj_id: str) -> str:
    return traj_id.rpartition("/")[2]


def test_swe_halves_split_by_instance_and_cover_the_trace() -> None:
    full = _source("swe")
    dev, report = half(full, "dev"), half(full, "report")
    d = {_instance(t.traj_id) for t in dev.trace.trajectories}  # type: ignore[attr-defined]
    r = {_instance(t.traj_id) for t in report.trace.trajectories}  # type: ignore[attr-defined]
    assert d and r and not d & r  # every run of an instance on one side
    assert max(d) < min(r)  # dev: the alphabetically first half
    n = len(dev.trace.trajectories) + len(report.trace.trajectories)  # type: ignore[attr-defined]
    assert n == len(full.trace.trajectories)  # type: ignore[attr-defined]


def test_timed_trace_halves_are_the_first_and_second_half_in_time() -> None:
    full = _source("azure-code")
    dev, report = half(full, "dev"), half(full, "report")
    last_dev = max(t.arrival_s for t in dev.trace.trajectories)  # type: ignore[attr-defined]
    first_report = min(t.arrival_s for t in report.trace.trajectories)  # type: ignore[attr-defined]
    assert last_dev <= first_report


def test_profile_and_mix_halves_draw_different_trajectories() -> None:
    a = split_workload("profile:coding", "dev", batch_size=8, group_size=1, seed=0).step(0)
    b = split_workload("profile:coding", "report", batch_size=8, group_size=1, seed=0).step(0)
    assert [t.turns for t in a] != [t.turns for t in b]
    mix = split_workload("mix:swe+profile:math", "report", batch_size=8, group_size=1, seed=0)
    assert mix.name == "mix:swe+profile:math[report]"
    swe_ids = {_instance(t.traj_id) for t in half(_source("swe"), "report").trace.trajectories}  # type: ignore[attr-defined]
    assert len(mix.step(0)) == 8 and swe_ids
    whole = split_workload("swe", "all", batch_size=8, group_size=1, seed=0)
    assert whole.name == "swe"


def test_a_trace_of_one_instance_cannot_be_split(tmp_path) -> None:
    path = tmp_path / "one.csv"
    path.write_text(
        "run,instance,turn,prompt_tokens,completion_tokens,tool_latency_s\nr,i,0,100,10,0.1\nr,i,1,150,10,0\n"
    )
    with pytest.raises(WorkloadError, match="nothing to split"):
        split_workload(f"trace:{path}", "report", batch_size=2, group_size=1, seed=0)


def test_value_rows_naive_predictor_and_truth() -> None:
    config = SimConfig(workload="profile:math", engines=3, batch_size=8, seed=3, steps=1)
    rows = predictor_value(config, ["lifecycle"], policy="prorsa")
    assert list(rows) == ["naive", "lifecycle", "truth"]
    for row in rows.values():
        assert row["avg_trajectory_s"] > 0 and row["rollout_s"] > 0
    assert rows["truth"]["pass"] >= 2
    if rows["naive"]["capture_avg_trajectory_s"] is not None:
        assert rows["naive"]["capture_avg_trajectory_s"] == 0.0
        assert rows["truth"]["capture_avg_trajectory_s"] == pytest.approx(1.0)
    again = predictor_value(config, ["lifecycle"], policy="prorsa")
    assert again == rows  # deterministic
    with pytest.raises(ValueError, match="forecasting policy"):
        predictor_value(config, ["lifecycle"], policy="colocated")

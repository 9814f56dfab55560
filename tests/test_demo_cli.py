"""`prorsa demo`, the README's main job, end to end on a tiny configuration: the simulator picks the best fixed
split, then three live rollouts (colocated, that split, prorsa) over a real nats-server with every service, with
the simulator's rows for the same workload beside them."""

from __future__ import annotations

import json
import os

import pytest

from prorsa.cli import main
from tests.browser import render

pytestmark = pytest.mark.timeout(240)


def test_demo_compares_both_policies_live_and_simulated(tmp_path, capsys, chromium) -> None:
    out = tmp_path / "demo.json"
    argv = ["demo", "--workload", "profile:math", "--batch-size", "2", "--engines", "2", "--speedup", "50"]
    before = os.environ.get("PRORSA_TIME_SCALE")
    rc = main([*argv, "--training-s", "1", "--json", str(out), "--report", str(tmp_path / "report")])
    assert os.environ.get("PRORSA_TIME_SCALE") == before  # the runs restored the process clock (next test)
    assert rc == 0
    data = json.loads(out.read_text())
    # Two engines: one fixed split exists, and the simulator ran it beside colocated and prorsa.
    assert data["static"] == "static:1:1"
    assert set(data["simulated_splits"]) == {"colocated", "static:1:1", "prorsa"}
    for side in ("live", "simulated"):
        assert set(data[side]) == {"colocated", "static:1:1", "prorsa"}
        for row in data[side].values():
            assert row["trajectories_completed"] == row["trajectories_expected"] == 2
            assert row["avg_trajectory_s"] > 0
    # The live system tracks its model: same trajectories, a bounded gap (wall-clock latency × the speed-up).
    for policy in ("colocated", "static:1:1", "prorsa"):
        ratio = data["live"][policy]["avg_trajectory_s"] / data["simulated"][policy]["avg_trajectory_s"]
        assert 0.8 < ratio < 1.6, (policy, ratio)
    text = capsys.readouterr().out
    for label in ("live", "simulated"):
        assert f"{label}: colocated / prorsa" in text and f"{label}: static:1:1 / prorsa" in text
    assert "best fixed split in the simulator: static:1:1" in text
    # The report: the live runs and the simulator's beside them, every plot drawn, nothing logged.
    page = tmp_path / "report" / "demo.html"
    assert f"report: {page}" in text
    shown = render(chromium, page)
    assert shown.console == []
    runs = ("colocated", "static:1:1", "prorsa", "sim colocated", "sim static:1:1", "sim prorsa")
    drawn = {k for k, v in shown.plots.items() if v == "figure"}
    assert {f"{r}:{kind}" for r in runs for kind in ("roles", "demand")} | {"all:trajectory_times"} <= drawn
    assert {"prorsa:forecast", "sim prorsa:forecast"} <= drawn


def test_a_live_run_leaves_the_process_time_scale_as_it_found_it(monkeypatch) -> None:
    """`run_live` sets PRORSA_TIME_SCALE for its child processes; a test session running it in process must not
    inherit the speed-up (it once left later tests' drain timeouts and stream clocks 50× short)."""
    from services.runtime.clock import Clock, time_scale_set

    monkeypatch.delenv("PRORSA_TIME_SCALE", raising=False)
    with time_scale_set(50.0):
        assert Clock.from_env().time_scale == 50.0
    assert "PRORSA_TIME_SCALE" not in os.environ
    monkeypatch.setenv("PRORSA_TIME_SCALE", "4")
    with time_scale_set(50.0):
        pass
    assert Clock.from_env().time_scale == 4.0

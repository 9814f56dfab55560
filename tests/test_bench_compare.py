"""`prorsa bench`: every policy on one workload and seed; static:best is the best split of the sweep."""

from __future__ import annotations

import json
import subprocess
import sys

from prorsa.bench.compare import compare_policies, expand_policies
from prorsa.sim.runner import SimConfig


def test_static_best_expands_to_every_split() -> None:
    assert expand_policies(["colocated", "static:best", "static:1:3"], 4) == [
        "colocated",
        "static:1:3",
        "static:2:2",
        "static:3:1",
    ]


def test_compare_picks_the_best_static_split_and_reports_errors() -> None:
    base = SimConfig(workload="profile:math", engines=3, batch_size=6, seed=1, policy="colocated")
    rows, full = compare_policies(base, ["colocated", "static:best", "static:2:2"])
    by = {r["policy"]: r for r in rows}
    best = by["static:best"]
    assert best["chosen"] in ("static:1:2", "static:2:1")
    assert best["avg_trajectory_s"] == min(full[s]["avg_trajectory_s"] for s in ("static:1:2", "static:2:1"))
    assert by["colocated"]["trajectories_completed"] == 6
    assert "error" in by["static:2:2"]  # 4 engines asked of a cluster of 3


def test_cli_writes_the_json_shape(tmp_path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "prorsa",
            "bench",
            "--workload",
            "profile:math",
            "--engines",
            "2",
            "--batch-size",
            "4",
            "--policies",
            "colocated,static:1:1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert [r["policy"] for r in data["results"]] == ["colocated", "static:1:1"]
    for r in data["results"]:
        assert {
            "avg_trajectory_s",
            "p99_trajectory_s",
            "rollout_s",
            "switches" if False else "role_switches",
        } <= set(r)

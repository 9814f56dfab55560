"""`prorsa sim` as a command: table, JSON result, plot, and errors as exit code 2."""

from __future__ import annotations

import argparse
import json

from prorsa.sim.cli import add_sim_arguments, run_sim_command


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    return parser.parse_args(list(argv))


def test_sim_command_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = _args(
        "--workload",
        "profile:math",
        "--engines",
        "4",
        "--policy",
        "static:1:3",
        "--batch-size",
        "8",
        "--steps",
        "1",
        "--training-s",
        "5",
        "--json",
        str(out),
        "--plot",
        str(png),
    )
    assert run_sim_command(args) == 0
    data = json.loads(out.read_text())
    for key in (
        "avg_trajectory_s",
        "p50_trajectory_s",
        "p99_trajectory_s",
        "rollout_s",
        "tokens_per_s",
        "utilisation",
        "role_switches",
        "prefix_cache_hit_rate",
        "windows",
        "trajectories_completed",
        "trajectories_expected",
        "config",
    ):
        assert key in data
    assert data["trajectories_completed"] == data["trajectories_expected"] == 8
    assert data["config"]["policy"] == "static:1:3"
    assert png.stat().st_size > 10_000
    assert "rollout" in capsys.readouterr().out


def test_sim_command_reports_bad_input(capsys):
    assert run_sim_command(_args("--policy", "static:9:9", "--engines", "4")) == 2
    assert "static" in capsys.readouterr().err
    assert run_sim_command(_args("--profile", "no-such-model")) == 2
    assert run_sim_command(_args("--workload", "profile:nope")) == 2

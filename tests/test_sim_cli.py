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


def test_sim_command_gives_the_engines_a_host_kv_tier(tmp_path, capsys):
    # 48 agent trajectories on one engine: more context than its GPUs hold
    common = ("--workload", "profile:general", "--engines", "1", "--batch-size", "48", "--steps", "1")
    on, off = tmp_path / "on.json", tmp_path / "off.json"
    assert run_sim_command(_args(*common, "--host-kv-ratio", "2", "--json", str(on))) == 0
    assert "from host" in capsys.readouterr().out
    assert run_sim_command(_args(*common, "--json", str(off))) == 0
    tiered, plain = json.loads(on.read_text()), json.loads(off.read_text())
    assert tiered["config"]["host_kv_ratio"] == 2.0 and "host_kv_ratio" not in plain["config"]
    by_tier = tiered["prefix_cache_hit_rate_by_tier"]
    assert abs(by_tier["device"] + by_tier["host"] - tiered["prefix_cache_hit_rate"]) < 1e-12
    assert by_tier["host"] > 0.1 and tiered["prefix_cache_hit_rate"] > plain["prefix_cache_hit_rate"] + 0.1
    assert "prefix_cache_hit_rate_by_tier" not in plain  # without the tier the JSON keeps its shape
    assert _args().host_kv_ratio == 0.0  # off by default


def test_sim_command_refuses_a_host_tier_no_larger_than_the_device(capsys):
    assert run_sim_command(_args("--host-kv-ratio", "0.5")) == 2
    assert "host_kv_ratio" in capsys.readouterr().err
    assert run_sim_command(_args("--host-kv-ratio", "2", "--profile", "cpu-tiny")) == 2
    assert "CPU" in capsys.readouterr().err

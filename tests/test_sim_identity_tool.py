"""The simulator's identity gate (`prorsa.bench.sim_identity`) passes a tree against itself and catches a change."""

from __future__ import annotations

import json

from prorsa.bench.sim_identity import configurations, main

ONLY = "swe|colocated|grpo4"  # one small configuration, with its lifecycle events hashed


def test_the_matrix_covers_what_speed_work_can_break():
    names = configurations()
    assert any("dynamo16" in n and "drain0.2" in n for n in names)  # role switches and migrations
    assert any(n.endswith("async0") for n in names)  # aborts
    assert any("grpo" in n for n in names)  # shared group prefixes
    assert any(observe for _, observe in names.values())  # lifecycle events compared too


def test_compare_passes_on_the_same_tree_and_fails_on_a_changed_result(tmp_path, capsys):
    assert main(["save", str(tmp_path), "--only", ONLY]) == 0
    assert main(["compare", str(tmp_path), "--only", ONLY]) == 0
    assert "0 differing, 0 missing" in capsys.readouterr().out

    (saved,) = tmp_path.glob("*.json")
    record = json.loads(saved.read_text())
    results = json.loads(record["result"])
    results["observed"]["avg_trajectory_s"] += 1.0  # only the observed run's result
    record["result"] = json.dumps(results, sort_keys=True)
    saved.write_text(json.dumps(record))
    assert main(["compare", str(tmp_path), "--only", ONLY]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS" in out and "/observed/avg_trajectory_s" in out


def test_compare_reports_a_configuration_never_saved(tmp_path, capsys):
    assert main(["compare", str(tmp_path), "--only", ONLY]) == 1
    assert "MISSING" in capsys.readouterr().out

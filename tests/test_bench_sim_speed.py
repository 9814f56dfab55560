"""The simulator speed bench runs end to end and judges the median of repeated runs."""

from __future__ import annotations

import re

import pytest

from prorsa.bench.sim_speed import main


def test_repeated_runs_report_each_run_and_judge_the_median(capsys):
    assert main(["--workload", "swe", "--scale", "0.02", "--repeat", "3"]) == 0
    out = capsys.readouterr().out
    runs = [float(x) for x in re.findall(r"run \d/3: event loop ([\d.]+) s", out)]
    assert len(runs) == 3
    median = float(re.search(r"event loop median ([\d.]+) s of 3 runs", out).group(1))
    assert median == pytest.approx(sorted(runs)[1], abs=0.006)  # printed to 2 decimals
    assert re.search(r"[\d,]+ events .* [\d,]+ turns", out)
    assert "projected full scale" in out and "target <= 30 s:" in out


def test_a_single_run_reports_wall_and_cpu_seconds(capsys):
    assert main(["--workload", "profile:math", "--scale", "0.02"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"event loop [\d.]+ s \(total with workload loading [\d.]+ s wall, [\d.]+ s CPU\)", out)


def test_repeat_must_be_positive():
    with pytest.raises(SystemExit):
        main(["--repeat", "0"])

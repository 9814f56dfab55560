"""The HTML report of `prorsa bench` (the simulator's runs) and a report of a run that completed nothing,
opened in headless Chromium: no console message, every plot drawn, nothing fetched from anywhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prorsa.cli import main
from prorsa.report import from_live, from_sim_json, write_report
from prorsa.report.model import Forecasts, Windows, band_coverage
from prorsa.rollout.live import LiveResult
from prorsa.rollout.recorder import Recorder
from prorsa.sim import SimConfig, run_simulation
from proto import DemandForecast, EngineStats, HorizonForecast, Quantiles, TurnSubmitted
from tests.browser import render

pytestmark = pytest.mark.timeout(300)

BENCH = [
    "bench",
    "--workload",
    "swe",
    "--engines",
    "4",
    "--batch-size",
    "6",
    "--training-s",
    "10",
    "--steps",
    "1",
]


def assert_self_contained(page: str) -> None:
    """Nothing the browser would fetch: no script, stylesheet link, image, font or frame, no remote URL."""
    assert not re.search(r"<(script|link|img|iframe|object|embed)\b", page)
    assert not re.search(r"(src|href)\s*=\s*['\"]?(https?:)?//", page)
    assert not re.search(r"url\((?!#)", page)  # only references inside the page (SVG clip paths)


def test_bench_report_renders_every_plot(tmp_path: Path, capsys, chromium: str) -> None:
    rc = main([*BENCH, "--policies", "colocated,static:best,prorsa", "--report", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    page = tmp_path / "bench.html"
    assert f"report: {page}" in out
    assert_self_contained(page.read_text())
    shown = render(chromium, page)
    assert shown.console == []
    names = ["colocated", "static:best → static:1:3", "prorsa"]
    assert {k: v for k, v in shown.plots.items() if v == "figure"}.keys() == {
        "all:trajectory_times",
        *(f"{n}:{kind}" for n in names for kind in ("roles", "demand")),
        "prorsa:forecast",  # the one policy of the three that plans on a forecast
    }, shown.plots
    assert shown.plots["colocated:forecast"] == "missing"
    assert "reads no demand forecast" in shown.dom
    for name in names:  # the comparison table has a column per run
        assert f"<th>{name}</th>" in shown.dom


def test_the_browser_check_sees_console_errors_and_undrawn_plots(tmp_path: Path, chromium: str) -> None:
    """The check above can fail: a page that logs and throws, and a figure without a drawing."""
    page = tmp_path / "bad.html"
    page.write_text(
        '<!DOCTYPE html><html><body><figure class="plot" data-plot="x:roles"></figure>'
        '<script>console.error("broken"); notDefined();</script></body></html>'
    )
    shown = render(chromium, page)
    assert len(shown.console) == 2 and "broken" in shown.console[0] and "notDefined" in shown.console[1]
    assert shown.plots == {"x:roles": "empty"}


def test_a_run_that_completed_nothing_says_so(tmp_path: Path, capsys, chromium: str) -> None:
    """Bad input: a bench capped before any trajectory ends still writes its report, with a clear message."""
    rc = main([*BENCH, "--policies", "colocated,prorsa", "--duration", "5", "--report", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "report: colocated: no trajectory completed" in out and "Traceback" not in out
    page = tmp_path / "bench.html"
    shown = render(chromium, page)
    assert shown.console == []
    assert shown.plots["all:trajectory_times"] == "missing"
    assert "No trajectory completed in any run" in shown.dom
    assert shown.plots["colocated:roles"] == "figure" and shown.plots["colocated:demand"] == "figure"


def test_a_live_recording_becomes_plots(tmp_path: Path, chromium: str) -> None:
    """`from_live` over real proto messages as the recorder holds them: roles (with a switch), demand against the
    profile's capacity, forecast against realised, exact trajectory times."""
    rec = Recorder()
    t0 = 1_780_000_000.0
    for k in range(40):
        t = t0 + k * 0.5
        for e, role in (("engine-0", "mixed" if k < 20 else "prefill"), ("engine-1", "mixed")):
            rec.stats.append(
                EngineStats(
                    engine_id=e,
                    ts_s=t,
                    role=role,
                    epoch=int(k >= 20),
                    prefill_tokens_per_s=900.0,
                    decode_tokens_per_s=120.0,
                    running=3,
                )
            )
        rec.turns.append(
            TurnSubmitted(
                traj_id=f"t{k % 4}",
                ts_s=t,
                turn=k // 4,
                request_id=f"t{k % 4}:{k // 4}",
                prompt_tokens=2000,
                new_tokens=200,
            )
        )
        q = Quantiles(q10=300.0, q50=400.0, q90=500.0)
        rec.forecasts.append(
            DemandForecast(
                ts_s=t,
                predictor="prorsa",
                horizons=[
                    HorizonForecast(
                        horizon_s=5.0, prefill_tokens=q, decode_tokens=q, decode_concurrency=q, kv_tokens=q
                    )
                ],
            )
        )
    summary = {"trajectories_completed": 3, "trajectories_expected": 4, "avg_trajectory_s": 12.0}
    run = from_live("prorsa", LiveResult(summary, rec, [], [11.0, 12.0, 13.0]), "qwen3-235b")
    assert run.roles["engine-0"] == [(0.0, "mixed"), (10.0, "prefill")]
    assert run.windows is not None and run.windows.prefill_capacity is not None
    assert max(run.windows.prefill_capacity) > 0 and run.completed == 3
    # 200 new tokens every 0.5 s: the realised prefill demand is 400 tokens/s wherever the series covers.
    assert run.windows.mean_rate(run.windows.prefill_demand, 2.0, 5.0) == pytest.approx(400.0)
    # The band (60..100 tokens/s) holds neither the realised prefill (400 tokens/s) nor decode: the caption says so.
    assert run.forecasts is not None
    cover = band_coverage(run.forecasts, run.windows)
    assert cover["prefill"][0] == 0.0 and cover["prefill"][1] > 20 and cover["decode"][0] == 0.0
    report = write_report(str(tmp_path), "live.html", "live", [run], [])
    assert report.notices == []
    assert "realised within it (nominal 80 %): prefill 0% of" in Path(report.path).read_text()
    shown = render(chromium, Path(report.path))
    assert shown.console == []
    assert set(shown.plots.values()) == {"figure"} and len(shown.plots) == 4


def test_sim_json_without_timelines_still_reports(tmp_path: Path) -> None:
    """The simulator's plain JSON (no `timelines`): demand plots only, the rest said to be missing."""
    result = run_simulation(SimConfig(workload="swe", engines=2, batch_size=2, training_s=5.0)).to_json()
    run = from_sim_json("colocated", result)
    page = Path(write_report(str(tmp_path), "r.html", "r", [run], []).path).read_text()
    assert 'class="missing" data-plot="colocated:roles"' in page
    assert '<figure class="plot" data-plot="colocated:demand"' in page


def test_a_live_run_that_recorded_nothing_says_so(tmp_path: Path) -> None:
    """Bad input: a live rollout that ended before any engine reported and no trajectory completed."""
    summary = {"trajectories_completed": 0, "trajectories_expected": 2}
    run = from_live("prorsa", LiveResult(summary, Recorder(), []), "qwen3-235b")
    report = write_report(str(tmp_path), "empty.html", "empty", [run], [])
    assert report.notices == ["prorsa: no trajectory completed, so it has no trajectory times"]
    page = Path(report.path).read_text()
    assert page.count('class="missing"') == 4 and "<svg" not in page


def test_band_coverage_counts_realised_rates_within_the_band() -> None:
    """Realised 100 tokens/s throughout; bands alternately around it and above it: half of them hold it. Forecasts
    whose horizon runs past the windows are not scored."""
    w = Windows(
        window_s=1.0,
        t_s=[float(k) for k in range(20)],
        prefill_demand=[100.0] * 20,
        prefill_computed=[0.0] * 20,
        decode=[100.0] * 20,
    )
    ts = [float(k) for k in range(20)]
    low = [90.0 if k % 2 == 0 else 150.0 for k in range(20)]
    band = (low, [110.0] * 20, [200.0] * 20)
    cover = band_coverage(Forecasts(t_s=ts, horizon_s=[5.0] * 20, prefill=band, decode=band), w)
    assert cover == {"prefill": (0.5, 16), "decode": (0.5, 16)}

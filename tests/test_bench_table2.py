"""The Table-2 benchmark: every cell runs every policy, the markdown and the plot come out, ratios are right."""

from __future__ import annotations

from prorsa.bench.compare import speedups
from prorsa.bench.table2 import Table2Options, markdown, plot, run_table2


def test_small_table_has_every_cell_and_policy(tmp_path) -> None:
    opts = Table2Options(
        workload="profile:math",
        engines=3,
        batch_size=6,
        steps=1,
        training_s=5.0,
        profiles=("qwen3-235b",),
        policies=("colocated", "static:best", "reactive"),
    )
    seen: list[str] = []
    table = run_table2(opts, seen.append)
    assert [(c["profile"], c["mode"]) for c in table["cells"]] == [
        ("qwen3-235b", "on-policy"),
        ("qwen3-235b", "staleness 2"),
        ("qwen3-235b", "staleness 8"),
    ]
    assert any("static:2:1" in s for s in seen)  # static:best swept every split
    for cell in table["cells"]:
        assert [r["policy"] for r in cell["results"]] == list(opts.policies)
        assert all("error" not in r for r in cell["results"])
        assert cell["speedup_over_colocated"]["colocated"] == 1.0
        assert cell["paper_speedup"] in (1.7, 1.9, 2.2)
    text = markdown(table)
    assert text.count("\n") == 2 + 3 and "| qwen3-235b | staleness 8 |" in text
    plot(table, str(tmp_path / "t2.png"))
    assert (tmp_path / "t2.png").stat().st_size > 1000


def test_speedups_skip_rows_that_failed() -> None:
    rows = [
        {"policy": "colocated", "avg_trajectory_s": 100.0},
        {"policy": "prorsa", "avg_trajectory_s": 50.0},
        {"policy": "oracle", "error": "no truth"},
    ]
    assert speedups(rows) == {"colocated": 1.0, "prorsa": 2.0, "oracle": None}

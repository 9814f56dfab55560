"""The concurrency matrix (prorsa/bench/concurrency.py): cells through one process pool, the summary per concurrency."""

from __future__ import annotations

import math

from prorsa.bench.concurrency import all_cells, run, summary, summary_markdown
from prorsa.bench.matrix import Cell


def test_the_matrix_spans_the_concurrencies_rl_runs_at() -> None:
    names = {c.name for c in all_cells()}
    assert "profile:general/deepseek-v3.2/on-policy/512" in names
    assert "profile:general/qwen3-235b/staleness 2/1024/16e" in names
    per_engine = {c.batch_size // (c.engines or 8) for c in all_cells()}
    assert per_engine == {16, 32, 64, 128}


def test_a_small_cell_runs_through_the_pool_and_is_summarised() -> None:
    cells = [
        Cell("profile:math", "qwen3-235b", "on-policy", 8, 2),
        Cell("profile:math", "qwen3-235b", "on-policy", 16, 4),
    ]
    heard: list[str] = []
    entries: list[dict] = []
    out = run(cells, ("colocated", "static:best", "prorsa"), 1, 0, 2, 1024, heard.append, entries.append)
    assert len(out) == 2 and all(e in out for e in entries) and len(entries) == 2
    assert [e["batch_size"] for e in out] == [8, 16]  # the order asked, whichever finished first
    # every simulation of both cells reported once: colocated, prorsa and the fixed splits (1 of 2 engines, 3 of 4)
    assert len(heard) == (2 + 1) + (2 + 3)
    for entry in out:
        by = {r["policy"]: r for r in entry["results"]}
        assert set(by) == {"colocated", "static:best", "prorsa"}
        best = min(by["colocated"]["avg_trajectory_s"], by["static:best"]["avg_trajectory_s"])
        assert math.isclose(
            entry["targets"]["prorsa_vs_best_baseline"], by["prorsa"]["avg_trajectory_s"] / best
        )
    rows = summary(out)
    assert [r["trajectories_per_engine"] for r in rows] == [4]  # 8 on 2 engines and 16 on 4: one concurrency
    ratios = [e["targets"]["prorsa_vs_best_baseline"] for e in out]
    assert math.isclose(rows[0]["prorsa_vs_best_base_geomean"], math.sqrt(ratios[0] * ratios[1]))
    assert rows[0]["prorsa_vs_oracle_geomean"] is None and "| 4 | 2 |" in summary_markdown(rows)


def test_cells_run_with_a_host_kv_tier_report_their_hit_rate_by_tier() -> None:
    cells = [
        Cell("profile:general", "qwen3-235b", "on-policy", 48, 1)
    ]  # more context than one engine's GPUs hold
    plain = run(cells, ("colocated",), 1, 0, 1, 0, lambda _: None, lambda _: None)
    tiered = run(cells, ("colocated",), 1, 0, 1, 0, lambda _: None, lambda _: None, host_kv_ratio=2.0)
    (row,), (tiered_row,) = plain[0]["results"], tiered[0]["results"]
    assert "prefix_cache_hit_rate_by_tier" not in row
    assert tiered_row["prefix_cache_hit_rate_by_tier"]["host"] > 0
    assert tiered_row["prefix_cache_hit_rate"] > row["prefix_cache_hit_rate"]

"""One cell of the allocator matrix (prorsa/bench/matrix.py), run small: what its JSON entry keeps for the plots."""

from __future__ import annotations

from prorsa.bench.matrix import Cell, run_cell


def test_a_cell_keeps_the_timelines_of_static_best_s_choice_and_of_every_split_asked_for_by_name() -> None:
    entry = run_cell(
        Cell("profile:math", "qwen3-235b", "on-policy", batch_size=4),
        steps=1,
        engines=4,
        seed=0,
        policies=("colocated", "static:best", "static:3:1"),
        progress=lambda _: None,
    )
    chosen = next(r["chosen"] for r in entry["results"] if r["policy"] == "static:best")
    # static:best sweeps 1:3, 2:2 and 3:1; only its choice and the split named in `policies` are drawn
    assert set(entry["timelines"]) == {"colocated", "static:3:1", chosen}
    assert {r["policy"] for r in entry["results"]} == {"colocated", "static:best", "static:3:1"}

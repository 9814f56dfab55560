"""The concurrency matrix: `python -m prorsa.bench.concurrency [--jobs N] [--cells PATTERNS] [--json F]
[--markdown F] [--plot-dir D]`.

The regime RL runs at: every policy on the general agent at 128, 256, 512 and 1,024 trajectories per step on 8
engines, and 1,024 on 16, for DeepSeek-V3.2-like (DP attention) and Qwen3-235B-like (TP8) engines, on-policy and at
staleness 2, two steps each, seed 0. Each cell is a `prorsa.bench.matrix` cell (same policies, same entry, same
plot), so every ratio is from one run; the simulations of all cells go through one pool of `--jobs` processes
(each run is a pure function of its config), the hindsight search among them — it forks the simulator at every
decision and dominates the wall time, so `--no-oracle` leaves it out and `--oracle-up-to` bounds the sizes it runs
at.

The summary gives, per concurrency (trajectories per engine), the geometric mean over its cells of prorsa / the
better of colocation and the best fixed split, and of prorsa / oracle where the oracle ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from typing import Any

from prorsa.bench.compare import assemble, expand_policies, run_spec
from prorsa.bench.matrix import MODES, POLICIES, Cell, cell_config, cell_entry, markdown, plot_cell, plot_name
from prorsa.bench.matrix import select as select_cells
from prorsa.sim.runner import SimConfig

WORKLOAD = "profile:general"
PROFILES = ("deepseek-v3.2", "qwen3-235b")
SIZES = ((128, 8), (256, 8), (512, 8), (1024, 8), (1024, 16))  # (trajectories per step, engines)
# prorsa@naive / prorsa@truth (the forecast's value) belong to the forecasts issue's matrix, not this one.
CONCURRENCY_POLICIES = tuple(p for p in POLICIES if "@" not in p)


def all_cells() -> list[Cell]:
    return [
        Cell(WORKLOAD, profile, mode, batch, 0 if engines == 8 else engines)
        for profile in PROFILES
        for batch, engines in SIZES
        for mode in MODES
    ]


def per_engine(entry: dict[str, Any]) -> int:
    """Trajectories per step per engine: the concurrency a cell stands for."""
    return entry["batch_size"] // entry["engines"]


def summary(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: geometric means of prorsa / best base and prorsa / oracle over its cells."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault(per_engine(c), []).append(c)

    def geomean(values: list[float]) -> float | None:
        return math.exp(sum(map(math.log, values)) / len(values)) if values else None

    out = []
    for k in sorted(groups):
        t = [c["targets"] for c in groups[k]]
        base = [x["prorsa_vs_best_baseline"] for x in t if "prorsa_vs_best_baseline" in x]
        oracle = [x["prorsa_vs_oracle"] for x in t if "prorsa_vs_oracle" in x]
        out.append(
            {
                "trajectories_per_engine": k,
                "cells": len(groups[k]),
                "prorsa_vs_best_base_geomean": geomean(base),
                "prorsa_vs_best_base_worst": max(base) if base else None,
                "prorsa_vs_oracle_geomean": geomean(oracle),
                "oracle_cells": len(oracle),
            }
        )
    return out


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    def f(v: float | None) -> str:
        return "–" if v is None else f"{v:.3f}"

    lines = [
        "| trajectories per engine | cells | prorsa / best base (geomean) | worst cell | prorsa / oracle (geomean) "
        "| oracle cells |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['trajectories_per_engine']} | {r['cells']} | {f(r['prorsa_vs_best_base_geomean'])} | "
            f"{f(r['prorsa_vs_best_base_worst'])} | {f(r['prorsa_vs_oracle_geomean'])} | {r['oracle_cells']} |"
        )
    return "\n".join(lines) + "\n"


def run(
    cells: list[Cell],
    policies: tuple[str, ...],
    steps: int,
    seed: int,
    jobs: int,
    oracle_up_to: int,
    progress: Callable[[str], None],
    on_cell: Callable[[dict[str, Any]], None],
    host_kv_ratio: float = 0.0,
) -> list[dict[str, Any]]:
    """Every (cell, simulation) through one process pool; `on_cell` hears each cell's entry once it is whole
    (cells in the order they complete; the result lists them in the order asked). `host_kv_ratio`: the engines'
    host KV tier (`SimConfig.host_kv_ratio`; 0 = none)."""
    plans: list[tuple[Cell, SimConfig, tuple[str, ...], list[str]]] = []
    for cell in cells:
        base = _with_host_kv(cell_config(cell, steps, 8, seed), host_kv_ratio)
        mine = tuple(p for p in policies if p != "oracle" or cell.batch_size <= oracle_up_to)
        plans.append((cell, base, mine, expand_policies(list(mine), base.engines)))
    total = sum(len(p[3]) for p in plans)
    t0 = time.perf_counter()
    entries: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        # The oracle's runs first: they are the longest, and the pool's other workers fill in around them.
        order = sorted(
            ((i, spec) for i, p in enumerate(plans) for spec in p[3]),
            key=lambda x: (x[1] != "oracle", -plans[x[0]][0].batch_size),
        )
        futures: dict[tuple[int, str], Future[dict[str, Any] | str]] = {
            (i, spec): pool.submit(run_spec, _with_policy(plans[i][1], spec)) for i, spec in order
        }
        # Progress as each simulation ends; a cell's entry once all of its simulations have (in any order).
        left = {i: len(p[3]) for i, p in enumerate(plans)}
        cell_of = {future: key for key, future in futures.items()}
        for done, future in enumerate(as_completed(futures.values()), 1):
            i, spec = cell_of[future]
            cell, base, mine, specs = plans[i]
            progress(f"[{time.perf_counter() - t0:7.1f} s] {done}/{total} {cell.name} · {spec}")
            left[i] -= 1
            if left[i]:
                continue
            rows, full = assemble(list(mine), {sp: futures[(i, sp)].result() for sp in specs})
            entry = cell_entry(cell, base, mine, rows, full, time.perf_counter() - t0)
            entries.append(entry)
            on_cell(entry)
    asked = [(c.workload, c.profile, c.mode, c.batch_size, c.engines or 8) for c in cells]

    def key(e: dict[str, Any]) -> int:
        return asked.index((e["workload"], e["profile"], e["mode"], e["batch_size"], e["engines"]))

    return sorted(entries, key=key)


def _with_policy(base: SimConfig, spec: str) -> SimConfig:
    import dataclasses

    return dataclasses.replace(base, policy=spec)


def _with_host_kv(base: SimConfig, ratio: float) -> SimConfig:
    import dataclasses

    return dataclasses.replace(base, host_kv_ratio=ratio) if ratio else base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prorsa.bench.concurrency", description=__doc__)
    parser.add_argument(
        "--cells", default=None, help="comma-separated fnmatch patterns over cell names (default: all)"
    )
    parser.add_argument("--steps", type=int, default=2, help="RL steps per run (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="simulations at once (default: cores)"
    )
    parser.add_argument(
        "--policies",
        default=",".join(CONCURRENCY_POLICIES),
        help="comma-separated specs (default: %(default)s)",
    )
    parser.add_argument(
        "--no-oracle", action="store_true", help="leave the hindsight search out (default: run it)"
    )
    parser.add_argument(
        "--oracle-up-to",
        type=int,
        default=1024,
        help="run the hindsight search only on cells of at most this many trajectories per step (default: 1024)",
    )
    parser.add_argument("--json", dest="json_path", default=None, help="write the cells here (default: none)")
    parser.add_argument("--markdown", default=None, help="write the tables here (default: none)")
    parser.add_argument(
        "--plot-dir", default=None, help="one role-timeline plot per cell here (default: none)"
    )
    parser.add_argument(
        "--host-kv-ratio",
        type=float,
        default=0.0,
        metavar="RATIO",
        help="engines get a host-memory KV tier of RATIO x their device KV (SGLang's --hicache-ratio, 2 by "
        "default there; services.runtime.host_kv); 0 = none (default: %(default)s)",
    )
    parser.add_argument("--list", action="store_true", help="print the cell names and exit")
    args = parser.parse_args(argv)
    cells = select_cells(all_cells(), args.cells)
    if args.list:
        print("\n".join(c.name for c in cells))
        return 0
    if not cells:
        print("prorsa.bench.concurrency: no cell matches --cells")
        return 2
    policies = tuple(p for p in args.policies.split(",") if p and not (args.no_oracle and p == "oracle"))
    out: dict[str, Any] = {
        "options": {"steps": args.steps, "seed": args.seed, "policies": policies, "sizes": SIZES}
        | ({"host_kv_ratio": args.host_kv_ratio} if args.host_kv_ratio else {}),
        "cells": [],
    }

    def on_cell(entry: dict[str, Any]) -> None:
        out["cells"].append(entry)
        out["summary"] = summary(out["cells"])
        if args.json_path:  # after every cell: a long run can be read while it goes on
            with open(args.json_path, "w") as f:
                json.dump(out, f, indent=1)
        if args.plot_dir:
            os.makedirs(args.plot_dir, exist_ok=True)
            fleet = 0 if entry["engines"] == 8 else entry["engines"]  # named in the file only when not 8
            cell = Cell(entry["workload"], entry["profile"], entry["mode"], entry["batch_size"], fleet)
            plot_cell(entry, os.path.join(args.plot_dir, plot_name(cell)))

    out["cells"] = run(
        cells,
        policies,
        args.steps,
        args.seed,
        args.jobs,
        args.oracle_up_to,
        lambda m: print(m, flush=True),
        on_cell,
        args.host_kv_ratio,
    )  # in the order asked (`on_cell` heard them as they completed)
    out["summary"] = summary(out["cells"])
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=1)
    text = markdown(out) + "\n" + summary_markdown(out["summary"])
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The allocator matrix: `python -m prorsa.bench.matrix [--cells PATTERNS] [--json F] [--markdown F] [--plot-dir D]`.

Every policy — colocated, static:best (every P:D split, the best kept), reactive, dynamo, prorsa, the hindsight
oracle — on every cell: workloads × model profiles × RL modes (on-policy and staleness 2), 8 engines, 128
trajectories per step (and the profile:general cells at 512), 4 steps, seed 0, all in one run per cell so every
comparison is a ratio from the same run. Beside them, `prorsa` fed the naive last-value forecast and the truth
(`prorsa@naive`, `prorsa@truth`): the value of the forecast. Each cell also gets the work-conserving bound on the
rollout: every token's work at the best rate the profile has, spread over every engine (new prompt tokens at a
prefill engine's rate, output tokens at a full decode batch's rate), plus the trainer's time in a synchronous
run — no schedule can beat it.

A cell is named `workload/profile/mode[/batch]` (e.g. `profile:general/deepseek-v3.2/on-policy/512`); `--cells`
takes comma-separated fnmatch patterns over those names. The JSON has one entry per cell:
`{"workload", "profile", "mode", "batch_size", "results": [{"policy", "avg_trajectory_s", "p99_trajectory_s",
"rollout_s", "switches"}, ...], "bound_rollout_s", "targets": {...}}`. Progress goes to the terminal.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prorsa.bench.compare import compare_policies
from prorsa.sim.runner import SimConfig
from services.runtime import perf_model as pm
from services.runtime.model_profiles import load_profile

WORKLOADS = (
    "swe",
    "profile:general",
    "profile:coding",
    "profile:math",
    "mix:profile:general/profile:math",
    "mix:profile:general+profile:math",
)
PROFILES = ("qwen3-235b", "deepseek-v3.2", "mimo-v2.5-pro")
MODES: dict[str, tuple[str, int]] = {"on-policy": ("sync", 1), "staleness 2": ("async", 2)}
POLICIES = (
    "colocated",
    "static:best",
    "reactive",
    "dynamo",
    "prorsa",
    "oracle",
    "prorsa@naive",
    "prorsa@truth",
)
LARGE_BATCH_WORKLOAD = "profile:general"
ROLE_COLOURS = {"prefill": "tab:blue", "decode": "tab:orange", "mixed": "tab:green", "switching": "tab:red"}


@dataclass(frozen=True)
class Cell:
    workload: str
    profile: str
    mode: str
    batch_size: int = 128
    engines: int = 0  # 0: the run's --engines

    @property
    def name(self) -> str:
        tail = "" if self.batch_size == 128 else f"/{self.batch_size}"
        fleet = f"/{self.engines}e" if self.engines else ""
        return f"{self.workload}/{self.profile}/{self.mode}{tail}{fleet}"


def all_cells(extra_workloads: tuple[str, ...] = ()) -> list[Cell]:
    cells = [Cell(w, p, m) for w in (*WORKLOADS, *extra_workloads) for p in PROFILES for m in MODES]
    cells += [Cell(LARGE_BATCH_WORKLOAD, p, m, 512) for p in PROFILES for m in MODES]
    return cells


def select(cells: list[Cell], patterns: str | None) -> list[Cell]:
    if not patterns:
        return cells
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    return [c for c in cells if any(fnmatch.fnmatchcase(c.name, p) for p in pats)]


def bound_rollout_s(full_json: dict[str, Any], profile: str, engines: int, steps: int, sync: bool) -> float:
    """The work-conserving bound (module doc), from a run's token counts (the same in every policy's run)."""
    p = load_profile(profile)
    tokens = full_json["tokens"]
    prefill_s = tokens["new_prompt_submitted"] / p.prefill_tokens_per_s
    decode_s = tokens["decoded"] / pm.decode_tokens_per_s_nominal(p)
    train = full_json["config"]["training_s"] * steps if sync else 0.0
    return (prefill_s + decode_s) / engines + train


def cell_config(cell: Cell, steps: int, engines: int, seed: int) -> SimConfig:
    """The simulation every policy of `cell` runs (its own fleet size where it names one, else `engines`)."""
    mode, staleness = MODES[cell.mode]
    return SimConfig(
        workload=cell.workload,
        profile=cell.profile,
        engines=cell.engines or engines,
        mode=mode,
        staleness=staleness,
        seed=seed,
        steps=steps,
        batch_size=cell.batch_size,
        forecaster="lifecycle",
    )


def run_cell(
    cell: Cell,
    steps: int,
    engines: int,
    seed: int,
    policies: tuple[str, ...],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    base = cell_config(cell, steps, engines, seed)
    t0 = time.perf_counter()
    rows, full = compare_policies(base, list(policies), lambda spec: progress(f"{cell.name} · {spec}"))
    return cell_entry(cell, base, policies, rows, full, time.perf_counter() - t0)


def cell_entry(
    cell: Cell,
    base: SimConfig,
    policies: tuple[str, ...],
    rows: list[dict[str, Any]],
    full: dict[str, dict],
    wall_s: float,
) -> dict[str, Any]:
    """The matrix JSON's entry for one cell from `compare_policies`' rows and full JSONs."""
    results = [
        {k: r[k] for k in ("policy", "avg_trajectory_s", "p99_trajectory_s", "rollout_s", "switches")}
        | ({"chosen": r["chosen"]} if "chosen" in r else {})
        | ({"prefix_cache_hit_rate": r["prefix_cache_hit_rate"]} if "prefix_cache_hit_rate" in r else {})
        | {k: r[k] for k in ("prefix_cache_hit_rate_by_tier",) if k in r}  # with a host KV tier only
        for r in rows
        if "error" not in r
    ]
    errors = {r["policy"]: r["error"] for r in rows if "error" in r}
    any_json = next(iter(full.values()))
    # every split static:best swept is in `full`: only its choice is drawn, and any split asked for by name
    drawn = {*policies, _chosen(rows)}
    entry: dict[str, Any] = {
        "workload": cell.workload,
        "profile": cell.profile,
        "mode": cell.mode,
        "batch_size": cell.batch_size,
        "engines": base.engines,
        "results": results,
        "bound_rollout_s": bound_rollout_s(
            any_json, cell.profile, base.engines, base.steps or 1, base.mode == "sync"
        ),
        "wall_s": wall_s,
        "timelines": {
            spec: {
                "t_s": j["windows"]["t_s"],
                "engines": j["windows"]["engines"],
                "prefill_demand": j["windows"]["prefill_demand_tokens_per_s"],
                "decode_tokens": j["windows"]["decode_tokens_per_s"],
            }
            for spec, j in full.items()
            if not spec.startswith("static:") or spec in drawn
        },
    }
    if errors:
        entry["errors"] = errors
    entry["targets"] = targets(entry)
    return entry


def _chosen(rows: list[dict[str, Any]]) -> str | None:
    return next((r.get("chosen") for r in rows if r["policy"] == "static:best"), None)


def targets(entry: dict[str, Any]) -> dict[str, Any]:
    """The issue's ratios for one cell (None where a policy is missing)."""
    by = {r["policy"]: r for r in entry["results"]}

    def avg(p: str) -> float | None:
        return by[p]["avg_trajectory_s"] if p in by else None

    out: dict[str, Any] = {}
    base = [v for v in (avg("colocated"), avg("static:best")) if v is not None]
    pro, ora = avg("prorsa"), avg("oracle")
    if pro is not None and base:
        out["prorsa_vs_best_baseline"] = pro / min(base)
        if avg("static:best"):
            out["speedup_vs_static_best"] = avg("static:best") / pro
    if pro is not None and ora is not None:
        out["prorsa_vs_oracle"] = pro / ora
    if ora is not None and base:
        out["oracle_vs_best_baseline"] = ora / min(base)
    peers = [v for v in (avg("reactive"), avg("dynamo")) if v is not None]
    if pro is not None and peers:
        out["prorsa_ahead_of_peers"] = pro <= min(peers)
    naive, truth = avg("prorsa@naive"), avg("prorsa@truth")
    if naive is not None and truth is not None and pro is not None and naive - truth > 1e-9:
        out["forecast_share_of_truth_gain"] = (naive - pro) / (naive - truth)
    return out


def markdown(matrix: dict[str, Any]) -> str:
    policies = list(matrix["options"]["policies"])
    head = ["cell", *policies, "bound rollout", "prorsa / best base", "prorsa / oracle", "oracle / best base"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in matrix["cells"]:
        by = {r["policy"]: r for r in c["results"]}
        cols = []
        for p in policies:
            r = by.get(p)
            if r is None:
                cols.append("–")
                continue
            extra = f" ({r['chosen'].removeprefix('static:')})" if "chosen" in r else ""
            sw = f" [{r['switches']}]" if r["switches"] else ""
            cols.append(f"{r['avg_trajectory_s']:.1f}{extra}{sw}")
        t = c["targets"]

        def f(key: str, t: dict[str, Any] = t) -> str:
            return f"{t[key]:.3f}" if key in t else "–"

        name = f"{c['workload']} · {c['profile']} · {c['mode']}" + (
            f" · {c['batch_size']}" if c["batch_size"] != 128 else ""
        )
        if c.get("engines", 8) != 8:
            name += f" · {c['engines']} engines"
        lines.append(
            f"| {name} | "
            + " | ".join(cols)
            + f" | {c['bound_rollout_s']:.0f} | {f('prorsa_vs_best_baseline')} | {f('prorsa_vs_oracle')} | "
            f"{f('oracle_vs_best_baseline')} |"
        )
    return "\n".join(lines) + "\n"


def plot_cell(entry: dict[str, Any], path: str) -> None:
    """Per policy: engines per role over time (stacked) and prefill demand; one column per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = entry["timelines"]
    fig, axes = plt.subplots(2, len(lines), figsize=(3.2 * len(lines), 5.5), sharex=True, squeeze=False)
    for i, (spec, tl) in enumerate(lines.items()):
        t = tl["t_s"]
        roles = [r for r in ROLE_COLOURS if any(tl["engines"].get(r, []))]
        axes[0][i].stackplot(
            t,
            *[tl["engines"][r] for r in roles],
            labels=roles,
            colors=[ROLE_COLOURS[r] for r in roles],
            step="post",
        )
        axes[0][i].set_title(spec, fontsize=9)
        axes[1][i].plot(t, tl["prefill_demand"], lw=0.8, label="new prompt tok/s")
        axes[1][i].plot(t, tl["decode_tokens"], lw=0.8, label="output tok/s")
        axes[1][i].set_yscale("symlog")
        axes[1][i].set_xlabel("virtual s")
    axes[0][0].set_ylabel("engines by role")
    axes[1][0].set_ylabel("demand")
    axes[0][0].legend(fontsize=7, loc="lower left")
    axes[1][0].legend(fontsize=7, loc="lower left")
    fig.suptitle(
        f"{entry['workload']} · {entry['profile']} · {entry['mode']} · {entry['batch_size']} per step"
        f" · {entry.get('engines', 8)} engines"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_name(cell: Cell) -> str:
    safe = cell.name.replace("/", "_").replace(":", "-").replace("+", "plus").replace(" ", "")
    return f"matrix-{safe}.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prorsa.bench.matrix", description=__doc__)
    parser.add_argument("--cells", default=None, help="comma-separated fnmatch patterns over cell names")
    parser.add_argument("--trace", action="append", default=[], help="add trace:PATH workloads (SWE columns)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--plot-dir", default=None)
    parser.add_argument("--list", action="store_true", help="print the cell names and exit")
    parser.add_argument("--replot", metavar="JSON", default=None, help="redraw --plot-dir from a matrix JSON")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        os.makedirs(args.plot_dir or ".", exist_ok=True)
        for entry in saved["cells"]:
            fleet = entry.get("engines", args.engines)
            cell = Cell(
                entry["workload"],
                entry["profile"],
                entry["mode"],
                entry["batch_size"],
                0 if fleet == args.engines else fleet,
            )
            plot_cell(entry, os.path.join(args.plot_dir or ".", plot_name(cell)))
        return 0
    cells = select(all_cells(tuple(f"trace:{p}" for p in args.trace)), args.cells)
    if args.list:
        print("\n".join(c.name for c in cells))
        return 0
    if not cells:
        print("prorsa.bench.matrix: no cell matches --cells")
        return 2
    policies = tuple(p for p in args.policies.split(",") if p)
    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "options": {"steps": args.steps, "engines": args.engines, "seed": args.seed, "policies": policies},
        "cells": [],
    }
    for i, cell in enumerate(cells, 1):
        entry = run_cell(
            cell,
            args.steps,
            args.engines,
            args.seed,
            policies,
            lambda msg, i=i: print(f"[{time.perf_counter() - t0:7.1f} s] {i}/{len(cells)} {msg}", flush=True),
        )
        out["cells"].append(entry)
        if args.json_path:  # written after every cell: a long run can be read while it goes on
            with open(args.json_path, "w") as f:
                json.dump(out, f, indent=1)
        if args.plot_dir:
            os.makedirs(args.plot_dir, exist_ok=True)
            plot_cell(entry, os.path.join(args.plot_dir, plot_name(cell)))
    text = markdown(out)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

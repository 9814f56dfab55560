"""What a fault campaign's tries add up to: the rows of its table, its totals, and the table as text or markdown.

Pure (no I/O): `build_report` turns the campaign's tries and the load's observations into the JSON the campaign
writes; `format_table` prints it. Lost turns, wrong results and recomputed turns are attributed to the fault in
whose window (from its start to the next fault's) they happened.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from prorsa.bench.fault_load import Load


def build_report(
    config: Any,
    tries: list[Any],
    load: Load,
    unfinished: list[str],
    client_stats: dict[str, int],
    wall_s: float,
) -> dict[str, Any]:
    """Rows per scenario (lost and duplicated results attributed to the fault whose window holds them), every
    try, and the totals."""
    starts = [t.t0 for t in tries]
    rows = []
    for name in dict.fromkeys(t.scenario for t in tries):
        mine = [t for t in tries if t.scenario == name]
        if not mine:
            continue
        windows = [(t.t0, _next(starts, t.t0)) for t in mine]

        def within(ts: float, windows: list[tuple[float, float]] = windows) -> bool:
            return any(a <= ts < b for a, b in windows)

        recs = [t.recovery_s for t in mine if t.recovery_s is not None]
        rows.append(
            {
                "fault": name,
                "tries": len(mine),
                "trajectories_lost": sum(1 for when, _ in load.lost_trajectories.values() if within(when)),
                "turns_lost": sum(1 for when, _, _ in load.lost_turns if within(when)),
                "duplicated_results": sum(1 for when, _ in load.wrong_results if within(when)),
                "recomputed_turns": sum(1 for when, _ in load.recomputed if within(when)),
                "recovery_p50_s": statistics.median(recs) if recs else None,
                "recovery_max_s": max(recs) if recs else None,
                "crashed": sum(len(t.crashed) for t in mine),
                "stuck": sum(len(t.stuck) for t in mine),
                "hostile_sent": sum(t.sent for t in mine) if name == "hostile-flood" else None,
                "hostile_counted": sum(t.counted for t in mine) if name == "hostile-flood" else None,
                "hostile_expected": sum(t.expected_count for t in mine) if name == "hostile-flood" else None,
                "hostile_refused": sum(t.refused for t in mine) if name == "hostile-flood" else None,
                "hostile_unconfirmed": sum(t.unconfirmed for t in mine) if name == "hostile-flood" else None,
                "hostile_slack": sum(t.expected_slack for t in mine) if name == "hostile-flood" else None,
                "notes": sorted({t.note for t in mine if t.note})[:3],
            }
        )
    return {
        "config": {**asdict(config), "load": asdict(config.load)},
        "rows": rows,
        "tries": [asdict(t) for t in tries],
        "totals": {
            "trajectories_started": len(load.started),
            "trajectories_finished": len(load.finished),
            "trajectories_lost": len(load.lost_trajectories) + len(unfinished),
            "unfinished_at_end": unfinished,
            "turns_done": len(load.turns_done),
            "turns_lost": len(load.lost_turns),
            "wrong_results": len(load.wrong_results),
            "recomputed_turns": len(load.recomputed),
            "wall_s": wall_s,
            **client_stats,
        },
    }


def _next(starts: list[float], t0: float) -> float:
    later = [s for s in starts if s > t0]
    return min(later) if later else float("inf")


COLUMNS = (
    ("fault", "fault"),
    ("tries", "tries"),
    ("trajectories_lost", "traj lost"),
    ("turns_lost", "turns lost"),
    ("duplicated_results", "dup results"),
    ("recomputed_turns", "recomputed"),
    ("recovery_p50_s", "recovery p50 s"),
    ("recovery_max_s", "recovery max s"),
    ("crashed", "crashed"),
    ("stuck", "stuck"),
)


def format_table(report: dict[str, Any], markdown: bool = False) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "–"
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    head = [h for _, h in COLUMNS]
    body = [[cell(row[k]) for k, _ in COLUMNS] for row in report["rows"]]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
    else:
        widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    for row in report["rows"]:
        if row["hostile_sent"] is not None:
            lines.append(
                f"hostile: {row['hostile_sent']} sent, {row['hostile_refused']} refused, "
                f"{row['hostile_unconfirmed']} unconfirmed; {row['hostile_counted']} counted as bad input "
                f"(expected {row['hostile_expected']}, up to {row['hostile_slack']} more from the unconfirmed: "
                "one per receiving service)"
            )
    t = report["totals"]
    lines.append(
        f"totals: {t['trajectories_finished']}/{t['trajectories_started']} trajectories finished, "
        f"{t['trajectories_lost']} lost, {t['turns_done']} turns, {t['wrong_results']} wrong results, "
        f"{t['recomputed_turns']} recomputed, client: {t['refused']} refused publishes, "
        f"{t['replayed_chunks']} chunks replayed, {t['early_retries']} early retries; {t['wall_s']:.0f} s wall"
    )
    return "\n".join(lines)

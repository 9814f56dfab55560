"""Tables and plots of live rollouts: the summary table, and per run the role of every engine and the served
prefill/decode throughput per role over time (from the engines' own stats)."""

from __future__ import annotations

from typing import Any

from prorsa.rollout.recorder import Recorder

SUMMARY_ROWS = (
    ("trajectories completed", "trajectories_completed", "{:.0f}"),
    ("cut at the context limit", "trajectories_truncated", "{:.0f}"),
    ("avg trajectory (s)", "avg_trajectory_s", "{:.1f}"),
    ("p99 trajectory (s)", "p99_trajectory_s", "{:.1f}"),
    ("rollout per step (s)", "rollout_s_per_step", "{:.1f}"),
    ("rollout total (s)", "rollout_s", "{:.1f}"),
    ("output tokens/s", "tokens_per_s", "{:.1f}"),
    ("role switches", "role_switches", "{:.0f}"),
    ("prefix-cache hit rate", "prefix_cache_hit_rate", "{:.3f}"),
    ("restarts", "restarts", "{:.0f}"),
)


def summary_table(rows: dict[str, dict[str, Any]], title: str) -> Any:
    """A rich Table with one column per run (e.g. per policy)."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    for name in rows:
        table.add_column(name, justify="right")
    for label, key, fmt in SUMMARY_ROWS:
        table.add_row(label, *(fmt.format(r[key]) if key in r else "–" for r in rows.values()))
    return table


def plot_live(recorder: Recorder, path: str, title: str) -> None:
    """Two panels: served prefill/decode tokens/s per role over time, and every engine's role over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = sorted(recorder.stats, key=lambda s: s.ts_s)
    if not stats:
        return
    t0 = stats[0].ts_s
    buckets: dict[int, dict[str, float]] = {}
    for s in stats:  # one-second buckets summed over engines
        b = buckets.setdefault(int(s.ts_s - t0), {"prefill": 0.0, "decode": 0.0})
        b["prefill"] += s.prefill_tokens_per_s
        b["decode"] += s.decode_tokens_per_s
    ts = sorted(buckets)
    fig, (ax_t, ax_r) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    ax_t.plot(ts, [buckets[t]["prefill"] for t in ts], label="prompt tokens/s computed (all engines)")
    ax_t.plot(ts, [buckets[t]["decode"] for t in ts], label="output tokens/s (all engines)")
    ax_t.set_ylabel("tokens/s")
    ax_t.legend(fontsize="small")
    colors = {"prefill": "tab:blue", "decode": "tab:orange", "mixed": "tab:green"}
    timeline = recorder.role_timeline()
    end = stats[-1].ts_s - t0
    for row, changes in enumerate(timeline[e] for e in sorted(timeline)):
        for i, (ts_s, role) in enumerate(changes):
            stop = changes[i + 1][0] - t0 if i + 1 < len(changes) else end
            ax_r.barh(row, stop - (ts_s - t0), left=ts_s - t0, color=colors[role], edgecolor="none")
    ax_r.set_yticks(range(len(timeline)), sorted(timeline))
    ax_r.set_xlabel("time (s)")
    ax_r.set_title("engine roles (blue prefill, orange decode, green mixed)", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

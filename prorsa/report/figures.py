"""The report's plots, each drawn with matplotlib (Agg) and returned as an inline SVG string.

SVG rather than PNG: text stays text (searchable, sharp at any zoom) and the page needs no decoding step; fonts
are not embedded (`svg.fonttype: none`), which keeps a plot to tens of kilobytes.
"""

from __future__ import annotations

import io
import math
from typing import Any

from prorsa.report.model import ROLE_COLOURS, RunData, Windows


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"
    return plt


def _svg(fig: Any) -> str:
    """The figure as an `<svg>` element (the XML prolog and doctype dropped: the page is HTML)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    _pyplot().close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def roles(run: RunData) -> str:
    """Every engine's role over time, one row per engine (grey while switching)."""
    plt = _pyplot()
    names = sorted(run.roles)
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(names) + 1.2))
    end = max([run.end_s, *(c[-1][0] for c in run.roles.values() if c)])
    for row, engine in enumerate(names):
        changes = run.roles[engine]
        for i, (t, role) in enumerate(changes):
            stop = changes[i + 1][0] if i + 1 < len(changes) else end
            ax.barh(row, max(stop - t, 0.0), left=t, color=ROLE_COLOURS.get(role, "black"), edgecolor="none")
    ax.set_yticks(range(len(names)), names)
    ax.set_xlim(0, end or 1.0)
    ax.set_xlabel("time (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLOURS.values()]
    ax.legend(
        handles, list(ROLE_COLOURS), ncol=4, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, 1.25)
    )
    return _svg(fig)


def demand(w: Windows) -> str:
    """Prefill demand and decode tokens against the capacity of the engines in each role."""
    plt = _pyplot()
    fig, (ax_p, ax_d) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    t = w.t_s
    ax_p.step(t, w.prefill_demand, where="post", label="demand: new prompt tokens arriving")
    ax_p.step(t, w.prefill_computed, where="post", label="prompt tokens computed", alpha=0.7)
    _capacity(ax_p, t, w.prefill_capacity, w.mixed_prefill_capacity, "prefill")
    # Log scale: capacity is often 10–100× the demand, which a linear axis would flatten to a line at zero.
    ax_p.set_yscale("log")
    ax_p.set_ylabel("prefill tokens/s")
    ax_p.legend(loc="upper right", fontsize="small")
    ax_d.step(t, w.decode, where="post", label="output tokens generated")
    _capacity(ax_d, t, w.decode_capacity, w.mixed_decode_capacity, "decode")
    ax_d.set_yscale("log")
    ax_d.set_ylabel("decode tokens/s")
    ax_d.set_xlabel("time (s)")
    ax_d.legend(loc="upper right", fontsize="small")
    return _svg(fig)


def _capacity(ax: Any, t: list[float], own: list[float] | None, mixed: list[float] | None, role: str) -> None:
    if own is not None and any(own):
        ax.step(t, own, where="post", ls="--", color="black", label=f"capacity: {role} engines")
    if mixed is not None and any(mixed):
        ax.step(t, mixed, where="post", ls=":", color="tab:green", label="capacity: mixed engines")


def forecast(run: RunData) -> str:
    """Each forecast (median and 10–90 % band, as a rate over its horizon) against what then happened over the
    same horizon, for prefill and decode."""
    plt = _pyplot()
    f, w = run.forecasts, run.windows
    assert f is not None and w is not None
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for ax, role, quantiles, series in (
        (axes[0], "prefill", f.prefill, w.prefill_demand),
        (axes[1], "decode", f.decode, w.decode),
    ):
        q10, q50, q90 = quantiles
        ax.fill_between(f.t_s, q10, q90, alpha=0.25, step="post", label="forecast q10–q90")
        ax.step(f.t_s, q50, where="post", label="forecast median")
        realised = [w.mean_rate(series, t, h) for t, h in zip(f.t_s, f.horizon_s, strict=True)]
        ax.plot(
            f.t_s, [math.nan if r is None else r for r in realised], color="black", lw=1, label="realised"
        )
        ax.set_ylabel(f"{role} tokens/s")
        ax.legend(loc="upper right", fontsize="small")
    horizons = sorted(set(f.horizon_s))
    axes[1].set_xlabel(f"time the forecast was made (s); horizon {', '.join(f'{h:g}' for h in horizons)} s")
    return _svg(fig)


def trajectory_times(runs: list[RunData]) -> str:
    """The cumulative distribution of trajectory completion times, one line per run that completed any."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    for run in runs:
        if not run.completed:
            continue
        xs, ys, seen = [0.0], [0.0], 0
        for value, count in run.trajectory_s:
            seen += count
            xs.append(value)
            ys.append(seen / run.completed)
        ax.step(xs, ys, where="post", label=f"{run.name} (n={run.completed})")
    ax.set_xlabel("trajectory completion time (s)")
    ax.set_ylabel("fraction completed within")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right", fontsize="small")
    return _svg(fig)

"""Demand vs capacity plots of a simulation's windowed series (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from typing import Any


def plot_windows(result_json: dict[str, Any], path: str) -> None:
    """Draw prefill demand vs prefill capacity, decode tokens vs decode capacity (per role), and the
    prefill:decode token ratio, one 10 s window per point, into `path` (format from its extension)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = result_json["windows"]
    t = w["t_s"]
    fig, (ax_p, ax_d, ax_r) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)

    ax_p.plot(t, w["prefill_demand_tokens_per_s"], label="new prompt tokens arriving")
    ax_p.plot(t, w["prefill_computed_tokens_per_s"], label="prompt tokens computed", alpha=0.7)
    ax_p.step(t, w["capacity_prefill_tokens_per_s"], where="post", label="capacity: prefill engines", ls="--")
    if any(w["capacity_mixed_prefill_tokens_per_s"]):
        ax_p.step(
            t, w["capacity_mixed_prefill_tokens_per_s"], where="post", label="capacity: mixed engines", ls=":"
        )
    ax_p.set_ylabel("prefill tokens/s")
    ax_p.legend(loc="upper right", fontsize="small")

    ax_d.plot(t, w["decode_tokens_per_s"], label="output tokens generated")
    ax_d.step(t, w["capacity_decode_tokens_per_s"], where="post", label="capacity: decode engines", ls="--")
    if any(w["capacity_mixed_decode_tokens_per_s"]):
        ax_d.step(
            t, w["capacity_mixed_decode_tokens_per_s"], where="post", label="capacity: mixed engines", ls=":"
        )
    ax_d.set_ylabel("decode tokens/s")
    ax_d.legend(loc="upper right", fontsize="small")

    ratio = [r if r is not None and r > 0 else float("nan") for r in w["prefill_decode_ratio"]]
    ax_r.plot(t, ratio, marker=".", lw=1)
    ax_r.set_yscale("log")
    ax_r.set_ylabel("new prefill : decode")
    ax_r.set_xlabel("virtual time (s)")

    cfg = result_json["config"]
    fig.suptitle(
        f"{cfg['workload']} · {cfg['profile']} · {cfg['engines']} engines · {cfg['policy']} · {cfg['mode']}"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

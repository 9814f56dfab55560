"""Draw a `TopView` with rich: engines, demand, the allocator's plan, trajectories by phase, throughput, and any
bad input seen on the bus. Pure: a view in, a renderable out."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from prorsa.top.state import TopView
from proto import TRAJECTORY_STATES

ROLE_STYLE = {"prefill": "blue", "decode": "dark_orange", "mixed": "green"}


def _tokens(n: float) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def _rate(x: float | None) -> str:
    return "–" if x is None else _tokens(x)


def engines_table(view: TopView) -> Table:
    t = Table(title="engines", title_justify="left", expand=False)
    for col in (
        "engine",
        "role",
        "epoch",
        "batch",
        "waiting",
        "in flight",
        "KV used",
        "prefix cache",
        "hit rate",
        "prefill tok/s",
        "decode tok/s",
    ):
        t.add_column(col, justify="left" if col in ("engine", "role") else "right")
    for r in view.engines:
        role = Text(r.role + (" →" if r.switching else ""), style=ROLE_STYLE.get(r.role, ""))
        kv = "–" if r.kv_fraction is None else f"{_tokens(r.kv_used_tokens)} ({r.kv_fraction:.0%})"
        name = Text(r.engine_id + (" (stale)" if r.stale else ""), style="dim" if r.stale else "")
        t.add_row(
            name,
            role,
            str(r.epoch),
            str(r.running),
            str(r.waiting),
            _tokens(r.in_flight_tokens),
            kv,
            _tokens(r.prefix_cache_tokens),
            f"{r.prefix_hit_rate:.2f}",
            _tokens(r.prefill_tokens_per_s),
            _tokens(r.decode_tokens_per_s),
        )
    if not view.engines:
        t.add_row("no engine stats yet", *[""] * 10)
    return t


def demand_table(view: TopView) -> Table:
    h = view.demand[0].horizon_s if view.demand else 0.0
    t = Table(title=f"demand (tokens/s over {h:g} s)" if view.demand else "demand", title_justify="left")
    for col in ("role", "forecast next (q10 · q50 · q90)", "forecast for last", "realised last"):
        t.add_column(col, justify="left" if col == "role" else "right")
    for d in view.demand:
        nxt = "–" if d.next_q is None else " · ".join(_tokens(x) for x in d.next_q)
        t.add_row(d.role, nxt, _rate(d.predicted), _rate(d.realised))
    if not view.demand:
        t.add_row("no forecast yet", "", "", "")
    return t


def plan_line(view: TopView) -> Text:
    p = view.plan
    if p is None:
        return Text("plan: none published yet", style="dim")
    roles = ", ".join(f"{n} {role}" for role, n in sorted(p.roles.items()))
    return Text(
        f"plan: epoch {p.epoch} · {p.policy} · {roles} · {p.reason or 'no reason given'} "
        f"({p.age_s:.0f} s ago) · switches acked {view.switches_acked}"
    )


def phases_line(view: TopView) -> Text:
    live = ", ".join(
        f"{s} {view.phases.get(s, 0)}"
        for s in TRAJECTORY_STATES
        if s in ("queued", "prefill", "decode", "tool_call")
    )
    return Text(
        f"trajectories: {live} · finished {view.finished_total}, aborted {view.aborted_total}, "
        f"lost {view.lost_total}"
    )


def render(view: TopView, title: str) -> RenderableType:
    services = ", ".join(f"{name} ×{n}" for name, n in view.services.items()) or "none answered"
    parts: list[RenderableType] = [
        Text(title, style="bold"),
        Text(f"services: {services}"),
        engines_table(view),
        demand_table(view),
        plan_line(view),
        phases_line(view),
        Text(
            f"throughput: prefill {_tokens(view.prefill_tokens_per_s)} tok/s · "
            f"decode {_tokens(view.decode_tokens_per_s)} tok/s"
        ),
    ]
    for problem in view.problems[:5]:
        parts.append(Text(f"bad input: {problem}", style="red"))
    return Group(*parts)

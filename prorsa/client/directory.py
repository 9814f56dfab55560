"""Which engines may take a trajectory's next turn directly (prefix affinity), from their `EngineStats`.

Pure. An engine is a valid affinity target only while its stats are fresh, it serves a prefill-capable role, it is
not switching, and its queue is short; otherwise the turn goes to the shared queue, where any prefill engine takes it.

Fresh means: seen within `missed_intervals` of its own stats interval (learnt from the gaps between its reports),
and never longer ago than `stale_after_s`. An engine that died is therefore dropped after about three missed
reports (0.75 s at a 0.25 s cadence, 3 s at 1 s), the same bound its peers use to rescue the work addressed to it
in the meantime (`services/engine_agent/rescue.py`), so a turn is addressed to a dead engine only in that window,
and such a turn is moved to the shared queue by a peer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto import EngineStats
from services.runtime.affinity import MAX_WAITING, stays

PREFILL_CAPABLE = ("prefill", "mixed")


@dataclass
class EngineDirectory:
    stale_after_s: float = 3.0  # upper bound on staleness, whatever the engine's cadence
    missed_intervals: float = 3.0
    min_stale_s: float = 0.5  # lower bound: jitter on a busy machine must not drop a live engine
    max_waiting: int = (
        MAX_WAITING  # a turn waits behind at least this many prompts (services.runtime.affinity)
    )
    engines: dict[str, EngineStats] = field(default_factory=dict)
    seen_at_s: dict[str, float] = field(default_factory=dict)
    interval_s: dict[str, float] = field(default_factory=dict)  # smoothed gap between an engine's reports

    def observe(self, stats: EngineStats, now: float) -> None:
        prev = self.engines.get(stats.engine_id)
        if prev is not None and stats.ts_s < prev.ts_s:
            return  # reordered: keep the newer picture
        last = self.seen_at_s.get(stats.engine_id)
        if last is not None and now > last:
            gap = now - last
            old = self.interval_s.get(stats.engine_id)
            self.interval_s[stats.engine_id] = gap if old is None else 0.8 * old + 0.2 * gap
        self.engines[stats.engine_id] = stats
        self.seen_at_s[stats.engine_id] = now

    def fresh(self, engine_id: str, now: float) -> bool:
        seen = self.seen_at_s.get(engine_id)
        if seen is None:
            return False
        interval = self.interval_s.get(engine_id)
        bound = self.stale_after_s
        if interval is not None:
            bound = min(bound, max(self.min_stale_s, self.missed_intervals * interval))
        return now - seen <= bound

    def accepts(self, stats: EngineStats, worth_prompts: float = 0.0) -> bool:
        """Whether an engine in the state `stats` reports takes a turn addressed to it."""
        return self.accepts_state(
            stats.role, stats.switching, stats.waiting + stats.addressed_waiting, worth_prompts
        )

    def accepts_state(self, role: str, switching: bool, waiting: int, worth_prompts: float = 0.0) -> bool:
        """`accepts` on the three fields it reads (the simulator's router asks with each engine's present state).
        `waiting`: every prompt queued for it, pulled or only addressed to it — a trajectory's turn that would wait
        behind more than `max_waiting` of them goes to the shared queue, where an idle engine takes it and becomes
        its home (one recompute): homes rebalance instead of piling up behind a few engines.
        `worth_prompts`: what recomputing the turn's whole context elsewhere costs, in prompts of its own uncached
        size (context / new tokens; 0 = unknown). Waiting behind fewer than that many costs less than the recompute,
        so the turn stays however long the queue is by count: a 60k-token context is worth 25 prompts of 2.4k new
        tokens, and sent away after 8 it recomputed 60k tokens to skip 20k (and, under DP attention, stalled every
        rank's decode meanwhile)."""
        return role in PREFILL_CAPABLE and not switching and stays(waiting, worth_prompts, self.max_waiting)

    def group_target(self, now: float) -> str | None:
        """Where a group of turns sharing one prompt (a GRPO group) should all go, so the prompt is prefilled and
        cached once: the least loaded engine that would take a turn addressed to it now (None: none would)."""
        ok = [s for e, s in self.engines.items() if self.fresh(e, now) and self.accepts(s)]
        if not ok:
            return None
        return min(ok, key=lambda s: (s.waiting + s.running, s.engine_id)).engine_id

    def affinity_target(self, engine_id: str, now: float, worth_prompts: float = 0.0) -> str | None:
        """`engine_id` if it can take the turn directly now, else None (use the shared queue); `worth_prompts` as
        in `accepts_state`."""
        s = self.engines.get(engine_id)
        if s is None or not self.fresh(engine_id, now) or not self.accepts(s, worth_prompts):
            return None
        return engine_id

"""Which engines may take a trajectory's next turn directly (prefix affinity), from their `EngineStats`.

Pure. An engine is a valid affinity target only while its stats are fresh, it serves a prefill-capable role, it is
not switching, and its queue is short; otherwise the turn goes to the shared queue, where any prefill engine takes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto import EngineStats

PREFILL_CAPABLE = ("prefill", "mixed")


@dataclass
class EngineDirectory:
    stale_after_s: float = 3.0
    max_waiting: int = 8  # beyond this queue depth affinity costs more than recomputing the prefix elsewhere
    engines: dict[str, EngineStats] = field(default_factory=dict)
    seen_at_s: dict[str, float] = field(default_factory=dict)

    def observe(self, stats: EngineStats, now: float) -> None:
        prev = self.engines.get(stats.engine_id)
        if prev is not None and stats.ts_s < prev.ts_s:
            return  # reordered: keep the newer picture
        self.engines[stats.engine_id] = stats
        self.seen_at_s[stats.engine_id] = now

    def affinity_target(self, engine_id: str, now: float) -> str | None:
        """`engine_id` if it can take the turn directly now, else None (use the shared queue)."""
        s = self.engines.get(engine_id)
        if s is None or now - self.seen_at_s.get(engine_id, -1e18) > self.stale_after_s:
            return None
        if s.role not in PREFILL_CAPABLE or s.switching or s.waiting > self.max_waiting:
            return None
        return engine_id

"""Streaming metrics of a simulation: token counters, completion-time quantiles, utilisation, 10 s windows.

Bounded memory: completion times go to a log-bucketed histogram (1 % relative resolution), time series to fixed
windows (one float per window and series), never per-event lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.runtime.time_windows import spread

ROLE_NAMES = ("prefill", "decode", "mixed")
SWITCHING = "switching"


class LogHistogram:
    """Counts positive values in buckets of ~1 % relative width; exact count, sum, min and max."""

    __slots__ = ("_buckets", "count", "total", "min", "max")
    _LOG_BASE = math.log(1.01)

    def __init__(self) -> None:
        self._buckets: dict[int, int] = {}
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)
        key = math.floor(math.log(value) / self._LOG_BASE) if value > 0 else -(10**9)
        self._buckets[key] = self._buckets.get(key, 0) + 1

    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def quantile(self, q: float) -> float:
        """Value at quantile q in [0, 1], interpolated linearly between the two order statistics around rank
        q·(count − 1) (numpy's default, which the live rollout's summary uses); an order statistic is its bucket's
        midpoint, the smallest and largest the exact min and max. 0 when empty."""
        if not self.count:
            return 0.0
        rank = q * (self.count - 1)
        lo = math.floor(rank)
        hi = min(lo + 1, self.count - 1)
        v_lo, v_hi = self._order_statistic(lo), self._order_statistic(hi)
        return v_lo + (rank - lo) * (v_hi - v_lo)

    def _order_statistic(self, index: int) -> float:
        """The index-th smallest value (0-based), to the bucket's resolution."""
        if index <= 0:
            return self.min
        if index >= self.count - 1:
            return self.max
        seen = 0
        for key in sorted(self._buckets):
            seen += self._buckets[key]
            if seen > index:
                mid = 0.0 if key == -(10**9) else math.exp((key + 0.5) * self._LOG_BASE)
                return min(max(mid, self.min), self.max)
        return self.max

    def buckets(self) -> list[tuple[float, int]]:
        """(bucket midpoint, count) in increasing order: the distribution to 1 % resolution."""
        out = []
        for key in sorted(self._buckets):
            mid = 0.0 if key == -(10**9) else math.exp((key + 0.5) * self._LOG_BASE)
            out.append((min(max(mid, self.min), self.max), self._buckets[key]))
        return out


@dataclass
class Windows:
    """Per-window sums of several series; window i covers [i·window_s, (i+1)·window_s)."""

    window_s: float
    series: dict[str, list[float]] = field(default_factory=dict)

    def row(self, name: str) -> list[float]:
        """The series' list of window sums (created empty; the same list for the whole run, grown in place)."""
        return self.series.setdefault(name, [])

    def add_at(self, name: str, t: float, amount: float) -> None:
        index = int(t / self.window_s)
        row = self.row(name)
        if len(row) <= index:
            row.extend([0.0] * (index + 1 - len(row)))
        row[index] += amount

    def add_span(self, name: str, t0: float, t1: float, amount: float) -> None:
        """Spread `amount` uniformly over [t0, t1] across the windows it overlaps."""
        spread(self.row(name), self.window_s, t0, t1, amount)

    def length(self) -> int:
        return max((len(r) for r in self.series.values()), default=0)

    def get(self, name: str, n: int) -> list[float]:
        row = self.series.get(name, [])
        return row[:n] + [0.0] * max(0, n - len(row))


class Metrics:
    """All counters of one run, with virtual times.

    The per-turn and per-step counters (turns submitted and the demand row, in `Driver.on_arrival`; busy seconds,
    prefill starts, prefill steps and decoded tokens, in `SimEngine`) are updated where they happen, on the hot path;
    role changes go through `role_change`.
    """

    def __init__(self, window_s: float = 10.0) -> None:
        self.windows = Windows(window_s)
        self.completion = LogHistogram()
        # Token accounting (conservation: computed + hits == prompt tokens of finished prefills).
        self.prompt_tokens = 0  # whole prompts of first-time prefills (not migrations)
        self.prefill_computed_tokens = 0
        self.prefix_hit_tokens = 0  # every tier's
        self.host_hit_tokens = 0  # of them, reloaded from the host KV tier (`ModelProfile.host_kv_tokens`)
        self.migration_recompute_tokens = 0  # re-prefill of migrated decodes (computed)
        self.migration_hit_tokens = 0
        self.wasted_prefill_tokens = 0  # computed for requests of aborted trajectories
        self.decoded_tokens = 0
        self.wasted_decoded_tokens = 0  # decoded by attempts later aborted
        self.new_prompt_tokens = 0  # the workload's new tokens of submitted turns (prefill demand)
        # Counts.
        self.turns_submitted = 0
        self.turns_finished = 0
        self.finished_output_tokens = 0  # output tokens of finished turns
        self.prefill_starts = 0  # first-time prefills started (not migrations)
        # Prefills of turns sent away from the engine that prefilled their trajectory's last turn, and the prompt
        # tokens they computed (`PrefillDone.away`: what the allocator's turn model charges a miss).
        self.away_prefills = 0
        self.away_computed_tokens = 0
        self.trajectories_started = 0
        self.trajectories_completed = 0
        self.trajectories_aborted = 0
        self.trajectories_truncated = 0  # ended when their context outgrew the model (counted as completed)
        self.migrations = 0
        self.role_switches = 0
        self.handoffs = 0
        # Engine time per role: in role (serving or draining) and busy.
        self.engine_s: dict[str, float] = dict.fromkeys((*ROLE_NAMES, SWITCHING), 0.0)
        self.busy_s: dict[str, float] = dict.fromkeys(ROLE_NAMES, 0.0)
        self._role_count: dict[str, int] = dict.fromkeys((*ROLE_NAMES, SWITCHING), 0)
        self._role_since = 0.0
        # Every engine's role at each change, (virtual s, engine id, role or "switching"): two entries per switch,
        # for the report's role timelines.
        self.role_log: list[tuple[float, str, str]] = []
        # The per-step series, held directly (touched on every engine step and turn; engines add to `decode_row`).
        self.window_s = window_s
        self.demand_row = self.windows.row("prefill_demand")
        self.computed_row = self.windows.row("prefill_computed")
        self.decode_row = self.windows.row("decode_tokens")

    # -- engine roles -----------------------------------------------------------------------------------------

    def role_change(self, now: float, old: str | None, new: str | None, engine_id: str = "") -> None:
        """An engine moved from `old` to `new` (role name, "switching", or None when it appears/disappears)."""
        self._flush_roles(now)
        if engine_id and new is not None:
            self.role_log.append((now, engine_id, new))
        if old is not None:
            self._role_count[old] -= 1
        if new is not None:
            self._role_count[new] += 1

    def _flush_roles(self, now: float) -> None:
        t0 = self._role_since
        if now > t0:
            for role, n in self._role_count.items():
                if n:
                    self.engine_s[role] += n * (now - t0)
                    self.windows.add_span(f"engine_s_{role}", t0, now, n * (now - t0))
        self._role_since = now

    def finish(self, now: float) -> None:
        """Close the role accounting at the end of the run."""
        self._flush_roles(now)

    def utilisation(self) -> dict[str, float | None]:
        """Busy fraction of engine time per role (None for a role no engine held)."""
        return {r: (self.busy_s[r] / self.engine_s[r] if self.engine_s[r] > 0 else None) for r in ROLE_NAMES}

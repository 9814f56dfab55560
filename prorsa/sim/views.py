"""What the allocator policy sees of the simulated cluster: a `ClusterView` per decision, built by the live
allocator's own `services.allocator.observed.build_view` from what it would observe.

Rates and request statistics cover the interval since the previous view (the policy's interval), measured from
cumulative counters. Live, an engine's rates cover its last stats interval (1 s) and its stats are up to that old;
here they cover the policy's interval and are current. `forecast` (with its demand outlook) comes from a
`DemandFeed` when the run has one (a policy that reads forecasts: `prorsa.sim.forecast_feed`, or the truth,
`prorsa.sim.truth_feed`), else it stays None.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prorsa.sim.engine import SimEngine
from prorsa.sim.metrics import Metrics
from proto import DemandForecast, EngineStats
from services.allocator.observed import QueueDepth, RecentLoad, RecentWindow, build_view
from services.allocator.policy import ClusterView

if TYPE_CHECKING:
    from prorsa.sim.core import Simulation


class DemandFeed(Protocol):
    """What fills a view's `forecast`: asked once per decision, with the engines' state at `now`."""

    def at(self, now: float, engines: Iterable[SimEngine]) -> object | None:
        """The demand forecast (with its outlook) from what happened up to `now`."""
        ...


class ViewBuilder:
    """Builds `ClusterView`s with the live allocator's `build_view`, from what the live allocator would observe:
    every engine's `EngineStats` (`SimEngine.stats`, token rates over the interval since the previous view), the
    commands in flight, the WORK stream's depth and the recent load. Remembers the counters of the previous view
    to turn totals into interval rates and means."""

    def __init__(self, sim: Simulation, feed: DemandFeed | None = None) -> None:
        self.sim = sim
        self.feed = feed
        self._t = 0.0
        self._engine_done: dict[str, tuple[int, int]] = {}  # engine_id → (prefill, decode) tokens done
        self._totals = _Totals()
        # Every forecast a decision read, for the report's forecast-vs-realised plot (one per policy tick).
        self.forecasts: list[DemandForecast] = []

    def build(self, now: float) -> ClusterView:
        sim = self.sim
        dt = now - self._t
        self._t = now
        stats = {e.engine_id: self._stats(e, now, dt) for e in sim.engines.values()}
        targets = {e.engine_id: e.target_role for e in sim.engines.values() if e.target_role}
        forecast = self.feed.at(now, sim.engines.values()) if self.feed is not None else None
        if isinstance(forecast, DemandForecast):
            self.forecasts.append(forecast)
        return build_view(
            now,
            stats,
            targets,
            {},
            self._queue_depth(),
            self._recent(dt),
            forecast=forecast,
        )

    def _stats(self, e: SimEngine, now: float, dt: float) -> EngineStats:
        prefill0, decode0 = self._engine_done.get(e.engine_id, (0, 0))
        self._engine_done[e.engine_id] = (e.prefill_tokens_done, e.decode_tokens_done)
        if dt <= 0:
            return e.stats(now)
        return e.stats(now, (e.prefill_tokens_done - prefill0) / dt, (e.decode_tokens_done - decode0) / dt)

    def _queue_depth(self) -> QueueDepth:
        """Messages in the WORK stream: not pulled yet, or pulled and not acked — a prompt until its prefill ends
        on a prefill engine (it is handed off) or its turn ends on a mixed one, a handoff until its decode ends."""
        router = self.sim.router
        prompts, handoffs = router.unpulled_prompts(), len(router.handoffs)
        for e in self.sim.engines.values():
            if e.role == "decode":
                handoffs += len(e.seqs) + len(e.arrivals) + e.incoming
            else:
                prompts += len(e.queue) + len(e.active) + (len(e.seqs) if e.role == "mixed" else 0)
        return QueueDepth(prefill_messages=prompts, decode_messages=handoffs)

    def _recent(self, dt: float) -> RecentWindow:
        """The live allocator's `RecentLoad` over the interval, from the run's totals."""
        now, before = _Totals.of(self.sim.metrics), self._totals
        self._totals = now
        load = RecentLoad(
            requests=now.submitted - before.submitted,
            submitted_new_tokens=now.new_prompt - before.new_prompt,
            submitted_prompt_tokens=now.prompt - before.prompt,
            prefills=now.starts - before.starts,
            prefill_new_tokens=(now.prompt - now.hits) - (before.prompt - before.hits),
            prefill_cached_tokens=now.hits - before.hits,
            away_prefills=now.away - before.away,
            away_new_tokens=now.away_computed - before.away_computed,
            finished=now.finished - before.finished,
            output_tokens=now.finished_out - before.finished_out,
        )
        return load.window(max(0.0, dt))


@dataclass(frozen=True, slots=True)
class _Totals:
    """The run's cumulative counters a view's recent load is the difference of."""

    submitted: int = 0
    new_prompt: int = 0
    prompt: int = 0
    starts: int = 0
    hits: int = 0
    finished: int = 0
    finished_out: int = 0
    away: int = 0
    away_computed: int = 0

    @staticmethod
    def of(m: Metrics) -> _Totals:
        return _Totals(
            m.turns_submitted,
            m.new_prompt_tokens,
            m.prompt_tokens,
            m.prefill_starts,
            m.prefix_hit_tokens,
            m.turns_finished,
            m.finished_output_tokens,
            m.away_prefills,
            m.away_computed_tokens,
        )

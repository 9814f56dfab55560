"""What the allocator policy sees of the simulated cluster: a `ClusterView` per decision.

Rates and request statistics cover the interval since the previous view (the policy's interval), measured from
cumulative counters, as the live allocator measures them from engine stats. `forecast` and `snapshot` come from a
`DemandFeed` when the run has one (a policy that reads forecasts: `prorsa.sim.forecast_feed`, or the oracle's truth,
`prorsa.sim.truth_feed`), else they stay None.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from prorsa.sim.engine import ACTIVE, SimEngine
from proto import DemandForecast
from services.allocator.policy import ClusterView, EngineView

if TYPE_CHECKING:
    from prorsa.sim.core import Simulation


class DemandFeed(Protocol):
    """What fills a view's `snapshot` and `forecast`: asked once per decision, with the engines' state at `now`."""

    def at(self, now: float, engines: Iterable[SimEngine]) -> tuple[object | None, object | None]:
        """(lifecycle snapshot, demand forecast) from what happened up to `now`."""
        ...


class ViewBuilder:
    """Builds `ClusterView`s; remembers the counters of the previous one to turn totals into interval rates."""

    def __init__(self, sim: Simulation, feed: DemandFeed | None = None) -> None:
        self.sim = sim
        self.feed = feed
        self._t = 0.0
        self._engine_done: dict[str, tuple[int, int]] = {}  # engine_id → (prefill, decode) tokens done
        self._computed = 0
        self._decoded = 0
        self._starts = 0
        self._prompt = 0
        self._hits = 0
        self._finished = 0
        self._finished_out = 0
        self._submitted = 0
        self._new_prompt = 0
        # Every forecast a decision read, for the report's forecast-vs-realised plot (one per policy tick).
        self.forecasts: list[DemandForecast] = []

    def build(self, now: float) -> ClusterView:
        sim, m = self.sim, self.sim.metrics
        dt = now - self._t
        engines = tuple(self._engine_view(e, dt) for e in sim.engines.values())
        computed = m.prefill_computed_tokens + m.migration_recompute_tokens
        starts = m.prefill_starts - self._starts
        finished = m.turns_finished - self._finished
        submitted = m.turns_submitted - self._submitted
        snapshot, forecast = (
            self.feed.at(now, sim.engines.values()) if self.feed is not None else (None, None)
        )
        if isinstance(forecast, DemandForecast):
            self.forecasts.append(forecast)
        view = ClusterView(
            now=now,
            engines=engines,
            prefill_queue_tokens=sim.router.queued_prompt_tokens()
            + sum(e.queued_tokens for e in sim.engines.values()),
            decode_queue_len=len(sim.router.handoffs),
            prefill_tokens_per_s=(computed - self._computed) / dt if dt > 0 else 0.0,
            decode_tokens_per_s=(m.decoded_tokens - self._decoded) / dt if dt > 0 else 0.0,
            forecast=forecast,
            snapshot=snapshot,
            recent_window_s=dt,
            recent_requests=submitted,
            recent_mean_isl_tokens=((m.prompt_tokens - self._prompt) - (m.prefix_hit_tokens - self._hits))
            / starts
            if starts
            else 0.0,
            recent_mean_cached_tokens=(m.prefix_hit_tokens - self._hits) / starts if starts else 0.0,
            recent_mean_osl_tokens=(m.finished_output_tokens - self._finished_out) / finished
            if finished
            else 0.0,
            recent_mean_new_tokens=(m.new_prompt_tokens - self._new_prompt) / submitted if submitted else 0.0,
        )
        self._t, self._computed, self._decoded = now, computed, m.decoded_tokens
        self._starts, self._prompt, self._hits = m.prefill_starts, m.prompt_tokens, m.prefix_hit_tokens
        self._finished, self._finished_out = m.turns_finished, m.finished_output_tokens
        self._submitted = m.turns_submitted
        self._new_prompt = m.new_prompt_tokens
        return view

    def _engine_view(self, e: SimEngine, dt: float) -> EngineView:
        prefill0, decode0 = self._engine_done.get(e.engine_id, (0, 0))
        self._engine_done[e.engine_id] = (e.prefill_tokens_done, e.decode_tokens_done)
        return EngineView(
            engine_id=e.engine_id,
            role=e.role,
            running=len(e.seqs) + len(e.active),
            waiting=len(e.queue) + len(e.arrivals),
            queued_prefill_tokens=e.queued_tokens,
            decode_batch=len(e.seqs),
            kv_used_tokens=e.kv_reserved,
            kv_capacity_tokens=e.p.kv_capacity_tokens,
            in_flight_tokens=e.tokens_in_flight(),
            switching=e.state != ACTIVE,
            target_role=e.target_role,
            prefill_tokens_per_s=(e.prefill_tokens_done - prefill0) / dt if dt > 0 else 0.0,
            decode_tokens_per_s=(e.decode_tokens_done - decode0) / dt if dt > 0 else 0.0,
            prefix_cache_tokens=e.cache.used_tokens,
        )

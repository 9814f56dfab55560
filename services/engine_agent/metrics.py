"""The engine agent's domain metrics: what an operator watches per engine.

Set from each `EngineStats` the agent publishes (so the series and the bus agree), plus the token counters and the
latency histograms of every finished request (times are the shared clock's seconds: workload seconds under a
simulated speed-up):
  prorsa_engine_role{engine, role}           1 for the role the engine serves, 0 for the others
  prorsa_engine_epoch{engine}                newest role-switch epoch applied
  prorsa_engine_switching{engine}            1 while switching role
  prorsa_engine_batch_requests{engine}       requests in the running batch
  prorsa_engine_waiting_requests{engine}     requests pulled, not yet running
  prorsa_engine_in_flight_tokens{engine}     tokens still to compute for the work it holds
  prorsa_engine_kv_used_tokens / prorsa_engine_kv_capacity_tokens{engine}
  prorsa_engine_prefix_cache_tokens{engine}  prompt tokens its prefix cache holds
  prorsa_engine_prefix_hit_ratio{engine}     cached / (computed + cached) prompt tokens, last interval
  prorsa_engine_prefill_tokens_total / prorsa_engine_decode_tokens_total{engine}   tokens computed / generated
  prorsa_ttft_seconds{engine}                submit → first token, per finished request (histogram)
  prorsa_tpot_seconds{engine}                time per output token after the first, per finished request
"""

from __future__ import annotations

from proto import ROLES, EngineStats, RequestFinished
from services.runtime.metrics import ServiceMetrics

TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
TPOT_BUCKETS_S = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)


class EngineMetrics:
    def __init__(self, m: ServiceMetrics, engine_id: str) -> None:
        def gauge(name: str, doc: str):  # noqa: ANN202 - a prometheus child
            return m.gauge(name, doc, ["engine"]).labels(engine=engine_id)

        role = m.gauge("prorsa_engine_role", "1 for the role the engine serves", ["engine", "role"])
        self._roles = {r: role.labels(engine=engine_id, role=r) for r in ROLES}
        self._epoch = gauge("prorsa_engine_epoch", "Newest role-switch epoch applied")
        self._switching = gauge("prorsa_engine_switching", "1 while the engine switches role")
        self._batch = gauge("prorsa_engine_batch_requests", "Requests in the running batch")
        self._waiting = gauge("prorsa_engine_waiting_requests", "Requests pulled but not yet running")
        self._in_flight = gauge("prorsa_engine_in_flight_tokens", "Tokens still to compute for held work")
        self._kv_used = gauge("prorsa_engine_kv_used_tokens", "KV cache in use")
        self._kv_capacity = gauge("prorsa_engine_kv_capacity_tokens", "KV cache capacity")
        self._prefix = gauge("prorsa_engine_prefix_cache_tokens", "Prompt tokens held by the prefix cache")
        self._hit = gauge("prorsa_engine_prefix_hit_ratio", "Prefix-cache hit ratio of recent prompts")
        self._prefill = m.counter(
            "prorsa_engine_prefill_tokens", "Prompt tokens computed", ["engine"]
        ).labels(engine=engine_id)
        self._decode = m.counter("prorsa_engine_decode_tokens", "Output tokens generated", ["engine"]).labels(
            engine=engine_id
        )
        self._ttft = m.histogram(
            "prorsa_ttft_seconds", "Time to first token per request", TTFT_BUCKETS_S, ["engine"]
        ).labels(engine=engine_id)
        self._tpot = m.histogram(
            "prorsa_tpot_seconds", "Time per output token after the first", TPOT_BUCKETS_S, ["engine"]
        ).labels(engine=engine_id)
        self._tokens = (0, 0)

    def observe(self, s: EngineStats, prefill_tokens: int, decode_tokens: int) -> None:
        """One stats report, with the runner's cumulative prompt tokens computed and output tokens generated."""
        for role, gauge in self._roles.items():
            gauge.set(1 if role == s.role else 0)
        self._epoch.set(s.epoch)
        self._switching.set(int(s.switching))
        self._batch.set(s.running)
        self._waiting.set(s.waiting)
        self._in_flight.set(s.in_flight_tokens)
        self._kv_used.set(s.kv_used_tokens)
        self._kv_capacity.set(s.kv_capacity_tokens)
        self._prefix.set(s.prefix_cache_tokens)
        self._hit.set(s.prefix_hit_rate)
        p0, d0 = self._tokens
        self._prefill.inc(max(0, prefill_tokens - p0))
        self._decode.inc(max(0, decode_tokens - d0))
        self._tokens = (max(p0, prefill_tokens), max(d0, decode_tokens))

    def on_finished(self, f: RequestFinished) -> None:
        if f.finish_reason == "abort" or f.output_tokens == 0:
            return
        self._ttft.observe(f.ttft_s)
        if f.output_tokens > 1 and f.e2e_s > f.ttft_s:
            self._tpot.observe((f.e2e_s - f.ttft_s) / (f.output_tokens - 1))

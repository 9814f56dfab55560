"""The gateway's Prometheus series (served on its own `/metrics`), all named `prorsa_gateway_*` except the prefix-break
counter, which the issue names `prorsa_prefix_breaks_total` (the SDK counts into the same name)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "prorsa_gateway_requests", "HTTP requests answered", ["endpoint", "code"], registry=r
        )
        self.errors = Counter("prorsa_gateway_errors", "Requests refused, by kind", ["kind"], registry=r)
        self.prefix_breaks = Counter(
            "prorsa_prefix_breaks",
            "Turns whose prompt did not extend the trajectory's previous prompt + output",
            registry=r,
        )
        self.aborts = Counter("prorsa_gateway_aborts", "Turns aborted, by cause", ["cause"], registry=r)
        self.sessions = Gauge("prorsa_gateway_sessions", "Sessions (trajectories) open", registry=r)
        self.in_flight = Gauge("prorsa_gateway_turns_in_flight", "Turns running", registry=r)
        self.turn_seconds = Histogram(
            "prorsa_gateway_turn_seconds",
            "Request received to response complete, per turn",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )

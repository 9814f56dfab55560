"""Prometheus metrics of one service instance: messages in and out per subject, errors by kind, event-loop lag.

Each service gets its own registry, so several services can live in one process (as under `prorsa up` in tests)
without clashing; `serve(port)` exposes it over HTTP when a port is configured.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class ServiceMetrics:
    def __init__(self, service: str, instance_id: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"service": service, "instance": instance_id}
        self._labels = labels
        self.messages_in = Counter(
            "prorsa_messages_in",
            "Messages received",
            ["service", "instance", "subject"],
            registry=self.registry,
        )
        self.messages_out = Counter(
            "prorsa_messages_out",
            "Messages published",
            ["service", "instance", "subject"],
            registry=self.registry,
        )
        self.errors = Counter(
            "prorsa_errors", "Errors by kind", ["service", "instance", "kind"], registry=self.registry
        )
        self.loop_lag = Histogram(
            "prorsa_event_loop_lag_seconds",
            "How late the event loop ran a scheduled tick",
            ["service", "instance"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=self.registry,
        )
        self.loop_lag_last = Gauge(
            "prorsa_event_loop_lag_last_seconds",
            "Last measured loop lag",
            ["service", "instance"],
            registry=self.registry,
        )
        # Plain counts mirrored for health replies and tests (prometheus counters are awkward to read back).
        self.error_counts: dict[str, int] = {}
        self.in_count = 0
        self.out_count = 0

    def count_in(self, subject: str) -> None:
        self.in_count += 1
        self.messages_in.labels(subject=_family(subject), **self._labels).inc()

    def count_out(self, subject: str) -> None:
        self.out_count += 1
        self.messages_out.labels(subject=_family(subject), **self._labels).inc()

    def count_error(self, kind: str) -> None:
        self.error_counts[kind] = self.error_counts.get(kind, 0) + 1
        self.errors.labels(kind=kind, **self._labels).inc()

    def observe_lag(self, lag_s: float) -> None:
        self.loop_lag.labels(**self._labels).observe(lag_s)
        self.loop_lag_last.labels(**self._labels).set(lag_s)

    def serve(self, port: int) -> None:
        start_http_server(port, addr="127.0.0.1", registry=self.registry)


def _family(subject: str) -> str:
    """Collapse per-engine/per-client subjects so label cardinality stays bounded."""
    parts = subject.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 else subject

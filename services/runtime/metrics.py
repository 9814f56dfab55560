"""Prometheus metrics of one service instance: messages in and out per subject, errors by kind, event-loop lag,
and the factories (`gauge`, `counter`, `histogram`) each service's domain metrics are made with.

Each service gets its own registry, so several services can live in one process (as under `prorsa up` in tests)
without clashing; `serve(port)` exposes it over HTTP when a port is configured, on 127.0.0.1 unless
$PRORSA_METRICS_ADDR says otherwise (a container sets 0.0.0.0 so that Prometheus can scrape it).

Every series carries the labels `service` and `instance`. Names follow Prometheus conventions: a `prorsa_` prefix,
base units in the name (`_seconds`, `_tokens`, `_requests`), counters ending in `_total` (prometheus_client adds
the suffix to a Counter's name).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

METRICS_ADDR_ENV = "PRORSA_METRICS_ADDR"


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
        for kind in (
            "decode",
            "schema_version",
            "handler",
        ):  # exist at 0 from the start: rate() sees the first
            self.errors.labels(kind=kind, **labels)
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
        self._server: Any = None
        # The labelled children of the per-message counters, by subject family: `labels()` validates and looks up
        # its keys under a lock (tens of µs), which every message in and out would pay again.
        self._in_by_family: dict[str, Any] = {}
        self._out_by_family: dict[str, Any] = {}

    # -- factories for the services' domain metrics ------------------------------------------------------------
    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        """A gauge with this instance's labels bound; the caller gives the rest (`.labels(**rest)` if any)."""
        return self._bind(Gauge(name, doc, ["service", "instance", *labels], registry=self.registry), labels)

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        return self._bind(
            Counter(name, doc, ["service", "instance", *labels], registry=self.registry), labels
        )

    def histogram(self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Any:
        metric = Histogram(
            name, doc, ["service", "instance", *labels], buckets=buckets, registry=self.registry
        )
        return self._bind(metric, labels)

    def _bind(self, metric: Any, labels: Sequence[str]) -> Any:
        if labels:
            return _Bound(metric, self._labels)
        return metric.labels(**self._labels)

    def count_in(self, subject: str) -> None:
        self.in_count += 1
        self._per_family(self.messages_in, self._in_by_family, subject).inc()

    def count_out(self, subject: str) -> None:
        self.out_count += 1
        self._per_family(self.messages_out, self._out_by_family, subject).inc()

    def _per_family(self, metric: Any, children: dict[str, Any], subject: str) -> Any:
        """`metric`'s child for `subject`'s family, made once and kept in `children`."""
        family = _family(subject)
        child = children.get(family)
        if child is None:
            child = children[family] = metric.labels(subject=family, **self._labels)
        return child

    def count_error(self, kind: str) -> None:
        self.error_counts[kind] = self.error_counts.get(kind, 0) + 1
        self.errors.labels(kind=kind, **self._labels).inc()

    def observe_lag(self, lag_s: float) -> None:
        self.loop_lag.labels(**self._labels).observe(lag_s)
        self.loop_lag_last.labels(**self._labels).set(lag_s)

    def serve(self, port: int) -> None:
        addr = os.environ.get(METRICS_ADDR_ENV, "127.0.0.1")
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)

    def close(self) -> None:
        """Stop serving (the HTTP server's thread ends; the port is free again)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Bound:
    """A labelled metric with `service` and `instance` already filled in: `.labels(role=...)` gives the child."""

    def __init__(self, metric: Any, base: dict[str, str]) -> None:
        self._metric = metric
        self._base = base

    def labels(self, **labels: str) -> Any:
        return self._metric.labels(**self._base, **labels)


def _family(subject: str) -> str:
    """Collapse per-engine/per-client subjects so label cardinality stays bounded."""
    parts = subject.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 else subject

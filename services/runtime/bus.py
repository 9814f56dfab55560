"""NATS connection and JetStream set-up shared by every service.

`connect()` wires all four connection callbacks to the log and reconnects forever, so a service outlives a
nats-server restart. `ensure_streams()` creates (or updates) the two streams of the flow idempotently:

- WORK: a work-queue stream for generation work. A message is removed once acknowledged, so an engine that dies
  before acking leaves its work to be redelivered to another engine after `ack_wait`.
- EVENTS: a limits stream retaining client lifecycle and engine events, so a tracker that restarts rebuilds its
  state by replaying it.
"""

from __future__ import annotations

import os
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from proto import Subjects

DEFAULT_EVENTS_MAX_AGE_S = 6 * 3600.0
# Deliveries of one message to a consumer at most (JetStream's `max_deliver`): a message that keeps failing is not
# redelivered forever. Work counts every redelivery after an engine died holding it, so its bound leaves room for
# many kills; an event only fails to apply through our bug, so a few tries are enough.
WORK_MAX_DELIVER = 20
EVENTS_MAX_DELIVER = 5


def nats_url_from_env(explicit: str | None = None) -> str | None:
    """The URL to use: the explicit one, else $PRORSA_NATS_URL, else None (= start an embedded server)."""
    return explicit or os.environ.get("PRORSA_NATS_URL") or None


def namespace_from_env(explicit: str | None = None) -> str:
    return explicit or os.environ.get("PRORSA_NAMESPACE", "prorsa")


async def connect(url: str, name: str, log: Any = None, **options: Any) -> NATS:
    """Connect with infinite reconnects; connection state changes are logged (and never crash the service)."""

    async def on_error(exc: Exception) -> None:
        if log is not None:
            log.warning("nats_error", error=repr(exc))

    async def on_disconnected() -> None:
        if log is not None:
            log.warning("nats_disconnected")

    async def on_reconnected() -> None:
        if log is not None:
            log.info("nats_reconnected", url=str(nc.connected_url.geturl()) if nc.connected_url else url)

    async def on_closed() -> None:
        if log is not None:
            log.info("nats_closed")

    opts: dict[str, Any] = {
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
        "connect_timeout": 5,
        "error_cb": on_error,
        "disconnected_cb": on_disconnected,
        "reconnected_cb": on_reconnected,
        "closed_cb": on_closed,
    }
    opts.update(options)
    nc = await nats.connect(url, **opts)
    return nc


async def ensure_streams(
    js: JetStreamContext, subjects: Subjects, events_max_age_s: float = DEFAULT_EVENTS_MAX_AGE_S
) -> None:
    """Create the WORK and EVENTS streams if missing; an existing stream is updated to the same config."""
    configs = [
        StreamConfig(
            name=subjects.work_stream,
            subjects=subjects.work_stream_subjects,
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
        ),
        StreamConfig(
            name=subjects.events_stream,
            subjects=subjects.events_stream_subjects,
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=events_max_age_s,
        ),
    ]
    for cfg in configs:
        try:
            await js.stream_info(cfg.name)
        except NotFoundError:
            try:
                await js.add_stream(cfg)
            except BadRequestError as exc:  # created concurrently by another service: fine
                if "already in use" not in str(exc):
                    raise
            continue
        await js.update_stream(cfg)

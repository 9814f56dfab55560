"""NATS connection and JetStream set-up shared by every service.

`connect()` wires all four connection callbacks to the log and reconnects forever, so a service outlives a
nats-server restart; it authenticates with the given `BusCredentials` (default: the PRORSA_NATS_* environment,
see `credentials.py`). `ensure_streams()` creates the two streams of the flow idempotently (and updates one
whose settings differ):

- WORK: a work-queue stream for generation work. A message is removed once acknowledged, so an engine that dies
  before acking leaves its work to be redelivered to another engine after `ack_wait`.
- EVENTS: a limits stream retaining client lifecycle and engine events, so a tracker that restarts rebuilds its
  state by replaying it.
"""

from __future__ import annotations

import os
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from proto import Subjects
from services.runtime.credentials import BusCredentials, CredentialsError

DEFAULT_EVENTS_MAX_AGE_S = 6 * 3600.0


def nats_url_from_env(explicit: str | None = None) -> str | None:
    """The URL to use: the explicit one, else $PRORSA_NATS_URL, else None (= start an embedded server)."""
    return explicit or os.environ.get("PRORSA_NATS_URL") or None


def namespace_from_env(explicit: str | None = None) -> str:
    return explicit or os.environ.get("PRORSA_NAMESPACE", "prorsa")


async def connect(
    url: str, name: str, log: Any = None, credentials: BusCredentials | None = None, **options: Any
) -> NATS:
    """Connect with infinite reconnects; connection state changes are logged (and never crash the service).
    `credentials` default to the environment's; `options` override any connect option (an `error_cb` given is
    called as well as ours). Raises CredentialsError for credentials that cannot work, or that the server refuses
    on the first connect: retrying a refused login forever would hide the mistake (a server that is not up yet,
    in contrast, is waited for)."""
    extra_error_cb = options.pop("error_cb", None)
    connecting = True

    async def on_error(exc: Exception) -> None:
        if log is not None:
            log.warning("nats_error", error=repr(exc))
        if extra_error_cb is not None:
            await extra_error_cb(exc)
        if connecting and "authorization violation" in str(exc).lower():
            raise CredentialsError(f"NATS at {url} refused the credentials of {name!r}: {exc}")

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
    opts.update((credentials or BusCredentials.from_env()).connect_options())
    opts.update(options)
    nc = NATS()
    try:
        await nc.connect(url, **opts)
    except CredentialsError:
        await nc.close()
        raise
    connecting = False
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
            info = await js.stream_info(cfg.name)
        except NotFoundError:
            try:
                await js.add_stream(cfg)
            except BadRequestError as exc:  # created concurrently by another service: fine
                if "already in use" not in str(exc):
                    raise
            continue
        if _as_wanted(info.config, cfg):
            continue  # nothing to write: under bus permissions only the operator may update a stream
        await js.update_stream(cfg)


def _as_wanted(have: StreamConfig, want: StreamConfig) -> bool:
    """Whether an existing stream already has every setting `ensure_streams` chooses."""
    return (
        sorted(have.subjects or []) == sorted(want.subjects or [])
        and have.retention == want.retention
        and have.storage == want.storage
        and abs((have.max_age or 0.0) - (want.max_age or 0.0)) < 1e-3
    )

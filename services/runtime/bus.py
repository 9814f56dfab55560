"""NATS connection and JetStream set-up shared by every service.

`connect()` wires all four connection callbacks to the log and reconnects forever, so a service outlives a
nats-server restart; it authenticates with the given `BusCredentials` (default: the PRORSA_NATS_* environment,
see `credentials.py`). `ensure_streams()` creates the two streams of the flow idempotently (and updates one
whose settings differ):

- WORK: a work-queue stream for generation work. A message is removed once acknowledged, so an engine that dies
  before acking leaves its work to be redelivered to another engine after `ack_wait`.
- EVENTS: a limits stream retaining client lifecycle and engine events, so a tracker that restarts rebuilds its
  state by replaying it.
- CONTEXT: a limits stream holding each live trajectory's context log (`proto/context_log.py`): the prompt
  segments a client writes before each turn, read back by an engine that lacks a turn's prefix. The client purges a
  trajectory's subjects when it finishes; `context_max_age_s()` bounds what a client that died leaves behind.
- POLICY (KV bucket `<NS>_POLICY`, stream `KV_<NS>_POLICY`): the current policy version and the pause flag
  (`proto.subjects`, "KV bucket NS_POLICY"), one value per key, file-backed: what an engine that starts reads
  before it pulls work.
- REPLIES: a limits stream keeping the token chunks engines publish on `ns.reply.>` for `REPLIES_MAX_AGE_S`.
  Engines publish them with plain core-NATS publishes (no acknowledgement to wait for, so streaming costs what it
  did), and clients receive them live through core subscriptions as before; the stream only lets a client read
  back what it missed while it was disconnected (a nats-server restart), so no result is lost with the server.

Backpressure. Each subject of WORK holds at most `work_queue_max()` messages (queued or held unacknowledged by an
engine; $PRORSA_WORK_QUEUE_MAX, default 4096): a publish beyond it is refused by the server (JetStream error 10077,
"maximum messages per subject exceeded") instead of growing the queue and its latency without bound. The client
SDK backs off and retries (`prorsa.client`), services wait for room (`Service.js_publish`); nothing is dropped.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import (
    APIError,
    BadRequestError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from proto import Subjects
from services.runtime.credentials import BusCredentials, CredentialsError

# What talking to the bus raises when a connection is gone, the server restarts or a peer stopped listening:
# nats-py's errors (all derive from nats.errors.Error), the socket's (OSError) and a wait that ran out. The places
# that publish, ack, fetch or unsubscribe on a best-effort basis catch these and nothing else: any other exception
# there is our bug, and it must surface.
BUS_ERRORS: tuple[type[Exception], ...] = (nats.errors.Error, OSError, TimeoutError)

DEFAULT_EVENTS_MAX_AGE_S = 6 * 3600.0
# Deliveries of one message to a consumer at most (JetStream's `max_deliver`): a message that keeps failing is not
# redelivered forever. Work counts every redelivery after an engine died holding it, so its bound leaves room for
# many kills; an event only fails to apply through our bug, so a few tries are enough.
WORK_MAX_DELIVER = 20
EVENTS_MAX_DELIVER = 5
REPLIES_MAX_AGE_S = 600.0  # wall seconds a token chunk stays readable after it was streamed
REPLIES_MAX_BYTES = 512 * 1024 * 1024  # the oldest chunks go first beyond this
DEFAULT_CONTEXT_MAX_AGE_S = 24 * 3600.0
# nats-server's own default max_payload (1 MiB): the lean wire keeps every message of a 256k-token context under it.
DEFAULT_MAX_PAYLOAD = 1024 * 1024
MAX_MAX_PAYLOAD = 64 * 1024 * 1024  # nats-server refuses more
QUEUE_FULL_ERR_CODE = 10077  # JetStream: "maximum messages per subject exceeded" (a full work queue)
DEFAULT_WORK_QUEUE_MAX = 4096


def work_queue_max() -> int:
    """Messages each WORK subject may hold: $PRORSA_WORK_QUEUE_MAX, default 4096 (every process must agree: the
    last `ensure_streams` sets it)."""
    raw = os.environ.get("PRORSA_WORK_QUEUE_MAX", "")
    try:
        value = int(raw) if raw else DEFAULT_WORK_QUEUE_MAX
    except ValueError as exc:
        raise ValueError(f"PRORSA_WORK_QUEUE_MAX must be an integer, got {raw!r}") from exc
    if value < 1:
        raise ValueError(f"PRORSA_WORK_QUEUE_MAX must be ≥ 1, got {value}")
    return value


def _env_number(name: str, default: float, low: float, high: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError as exc:
        raise ValueError(f"{name} must be a number, got {raw!r}") from exc
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value:g}")
    return value


def max_payload_bytes() -> int:
    """The largest message the bus takes, in bytes: $PRORSA_MAX_PAYLOAD, default 1 MiB (nats-server's default).
    An embedded server (`prorsa up`, tests) is started with it; a client checks what it publishes against the limit
    its server announces. Raise it on the nats-server of a cluster you run yourself, with the same variable for
    Prorsa's processes."""
    return int(_env_number("PRORSA_MAX_PAYLOAD", DEFAULT_MAX_PAYLOAD, 64 * 1024, MAX_MAX_PAYLOAD))


def context_max_age_s() -> float:
    """Seconds a context-log segment outlives its writer at most: $PRORSA_CONTEXT_MAX_AGE_S, default 24 h (longer
    than any trajectory should live; a finished trajectory's segments are purged at once)."""
    return _env_number("PRORSA_CONTEXT_MAX_AGE_S", DEFAULT_CONTEXT_MAX_AGE_S, 60.0, 365 * 86400.0)


class MessageTooLarge(ValueError):
    """A message over the server's max_payload: publishing it would only fail, so it is never sent."""


def check_size(subject: str, data: bytes, max_payload: int) -> bytes:
    """`data`, unless it exceeds `max_payload` (the server's, as announced). Raises MessageTooLarge naming both."""
    if len(data) > max_payload:
        raise MessageTooLarge(
            f"a message of {len(data)} bytes for {subject} exceeds the server's max_payload of {max_payload} bytes "
            "(a whole context sent without the lean wire? PRORSA_MAX_PAYLOAD and the server's config raise it)"
        )
    return data


def is_queue_full(exc: BaseException) -> bool:
    """True for the server's refusal of a publish into a full work queue (see the module doc)."""
    return isinstance(exc, APIError) and exc.err_code == QUEUE_FULL_ERR_CODE


# What a JetStream publish may raise while the server restarts or the connection reconnects: trying again later
# succeeds (with a message id, a retry of a publish that did land is dropped by the server as a duplicate).
# NoStreamResponseError: a nats-server stopping on SIGTERM shuts JetStream down before it closes the client
# connections, so for a moment a stream publish finds no responder; nats.py raises that as NoStreamResponseError,
# which is not a NoRespondersError. Not retrying it once killed a trajectory of the fault campaign (issue 14).
TRANSIENT_PUBLISH_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    NoStreamResponseError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.FlushTimeoutError,
    nats.errors.StaleConnectionError,
    ServiceUnavailableError,  # full queue (10077), or JetStream not ready yet after a restart
)


async def js_publish_patiently(
    js: JetStreamContext,
    subject: str,
    data: bytes,
    headers: dict[str, str] | None,
    wait_s: float,
    on_retry: Any = None,
) -> None:
    """Publish into a stream, retrying transient failures (see above) with backoff for up to `wait_s` wall seconds;
    then the last error is raised. `on_retry(exc)` is called before each retry (counting, logging)."""
    deadline = time.monotonic() + wait_s  # wall: an outage lasts real seconds, whatever the time scale
    delay = 0.05
    while True:
        try:
            await js.publish(subject, data, headers=headers)
            return
        except TRANSIENT_PUBLISH_ERRORS as exc:
            if time.monotonic() + delay > deadline:
                raise
            if on_retry is not None:
                on_retry(exc)
        await asyncio.sleep(delay * (0.5 + random.random()))  # jitter: many publishers must not retry in step
        delay = min(1.0, delay * 2)


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
    """Create the WORK, EVENTS, CONTEXT and REPLIES streams if missing; an existing stream is updated to the same config."""
    configs = [
        StreamConfig(
            name=subjects.work_stream,
            subjects=subjects.work_stream_subjects,
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            max_msgs_per_subject=work_queue_max(),
            discard=DiscardPolicy.NEW,
            discard_new_per_subject=True,
        ),
        StreamConfig(
            name=subjects.events_stream,
            subjects=subjects.events_stream_subjects,
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=events_max_age_s,
        ),
        StreamConfig(
            name=subjects.context_stream,
            subjects=subjects.context_stream_subjects,
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,  # survives engines and a server restart: that is its point
            max_age=context_max_age_s(),
            allow_direct=True,  # engines read segments with direct gets: no consumer per read
        ),
        StreamConfig(
            name=subjects.replies_stream,
            subjects=subjects.replies_stream_subjects,
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,  # survives a nats-server restart, which is the point
            max_age=REPLIES_MAX_AGE_S,
            max_bytes=REPLIES_MAX_BYTES,
            discard=DiscardPolicy.OLD,
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
    await policy_bucket(js, subjects)


async def policy_bucket(js: JetStreamContext, subjects: Subjects) -> KeyValue:
    """The policy KV bucket (current version, pause flag), created if missing. One value per key: only the current
    one matters, and the version history is the trainer's (its checkpoints). Raises BUS_ERRORS' kinds when the bus
    refuses (a role without the right to read it gets a permissions error)."""
    try:
        return await js.key_value(subjects.policy_bucket)
    except NotFoundError:
        pass
    try:
        return await js.create_key_value(
            KeyValueConfig(bucket=subjects.policy_bucket, history=1, storage=StorageType.FILE, direct=True)
        )
    except BadRequestError as exc:  # created concurrently by another process: fine
        if "already in use" not in str(exc):
            raise
    return await js.key_value(subjects.policy_bucket)


def _as_wanted(have: StreamConfig, want: StreamConfig) -> bool:
    """Whether an existing stream already has every setting `ensure_streams` chooses."""
    return (
        sorted(have.subjects or []) == sorted(want.subjects or [])
        and have.retention == want.retention
        and have.storage == want.storage
        and abs((have.max_age or 0.0) - (want.max_age or 0.0)) < 1e-3
    )

"""The async shell every Prorsa service is built on.

Lifecycle: `start()` connects (or is handed a connection), ensures the streams, answers health requests, starts the
event-loop lag probe and calls the subclass's `setup()`; `run()` additionally installs SIGINT/SIGTERM handlers and
waits until stopped; `stop()` stops the subclass's tasks, calls `teardown()` and drains the connection so nothing in
flight is lost.

Bad input never crashes a service: `receive()` decodes a message and, on a `ProtoError` (which `proto.decode` raises
for every failure of the decoder, RecursionError on deep nesting included), logs it with the subject, counts it by
kind and in `bad_input`, answers an `ErrorReply` where the message has a reply subject (else publishes it on the
errors subject), and terminates a JetStream message so it is not redelivered. A handler that fails on the bus
(`BUS_ERRORS`) is counted as `handler_bus`; any other handler failure is our bug (`note_bug`). A JetStream message
whose handler failed is nak'ed with a delay, and every consumer bounds its deliveries (`max_deliver`) so no message
is redelivered forever.

Health. A health request is answered only when it decodes as a `HealthRequest` (anything else is counted, never
answered: one stray message on the health subject must not fan out into one reply per service). A background task
that died of an exception (our bug) makes the service report `unhealthy` naming the task, for as long as it lives:
a service whose consuming loop is gone must not keep answering "ok". A bug that a deliberately broad catch survived
(`note_bug`: a handler, a periodic loop, a job) makes it report `degraded` (details: `bugs`) until that place next
succeeds (`clear_bug`).

Time. A service reads time from `self.clock` (`services.runtime.clock.Clock`, given at construction or read from
$PRORSA_TIME_SCALE then): every stamp it publishes (`ts_s`) is on that shared scaled clock, because receivers compare
stamps with their own. Its own health measurements (uptime, event-loop lag) stay in wall seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

import proto
from proto import ErrorReply, HealthReply, HealthRequest, Message, ProtoError, Subjects
from services.runtime.bus import (
    BUS_ERRORS,
    check_size,
    connect,
    ensure_streams,
    is_queue_full,
    js_publish_patiently,
)
from services.runtime.clock import Clock
from services.runtime.credentials import BusCredentials
from services.runtime.logging import get_logger
from services.runtime.metrics import ServiceMetrics

Handler = Callable[[Message, Msg], Awaitable[None]]
PUBLISH_WAIT_S = 30.0  # wall seconds a stream publish waits for room or for the server before it fails


class Service:
    """Base class: subclasses set `name` and override `setup()`, optionally `teardown()` and `health_details()`."""

    name = "service"

    def __init__(
        self,
        nats_url: str,
        namespace: str = "prorsa",
        instance_id: str | None = None,
        metrics_port: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        """`clock`: the scaled clock the service stamps and times with (None: $PRORSA_TIME_SCALE's, read now)."""
        self.nats_url = nats_url
        self.clock = clock if clock is not None else Clock.from_env()
        self.subjects = Subjects(namespace)
        self.instance_id = instance_id or f"{self.name}-{uuid.uuid4().hex[:8]}"
        self.metrics = ServiceMetrics(self.name, self.instance_id)
        self.metrics_port = metrics_port
        self.log = get_logger(self.name, self.instance_id)
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.credentials: BusCredentials | None = None  # None: the PRORSA_NATS_* environment's
        self._stop_event = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started_mono = time.monotonic()  # wall: uptime is the process's, not the workload's
        self.status: str = "ok"
        self.exit_code = 0  # what the process exits with once the service stopped (`run_service_main`)
        self.failed_tasks: dict[str, str] = {}  # task name -> its exception: reported as "unhealthy"
        self.bugs: dict[str, str] = {}  # where -> the last bug of ours a broad catch survived: "degraded"
        self.bad_input = 0  # messages rejected as bad input (undecodable, wrong type or version, invalid)
        # Subjects this instance consumes (core or JetStream): the hostile-input tests fire at each of them.
        self.consumed: list[str] = []

    # --- to override ------------------------------------------------------------------------------------------
    async def setup(self) -> None:
        """Subscribe and start background tasks (use `self.spawn`)."""

    async def teardown(self) -> None:
        """Flush state before the connection drains."""

    def health_details(self) -> dict[str, Any]:
        return {}

    # --- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.nc = await connect(
            self.nats_url, name=self.instance_id, log=self.log, credentials=self.credentials
        )
        self.js = self.nc.jetstream()
        await ensure_streams(self.js, self.subjects)
        await self.nc.subscribe(self.subjects.health, cb=self._on_health)
        if self.metrics_port:
            self.metrics.serve(self.metrics_port)
        self.spawn(self._probe_loop_lag())
        await self.setup()
        # A round trip to the server: it has processed our subscriptions, so a message published after start()
        # returns reaches us (core NATS drops what nobody is subscribed to yet).
        await self.nc.flush()
        self.log.info("service_started", nats=self.nats_url)

    async def run(self) -> None:
        """Start, then serve until SIGINT/SIGTERM or `request_stop()`, then stop gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        await self.start()
        try:
            await self._stop_event.wait()
        finally:
            await self.stop()

    def request_stop(self) -> None:
        self._stop_event.set()

    @property
    def stopping(self) -> bool:
        return self._stop_event.is_set()

    async def stop(self) -> None:
        self._stop_event.set()
        self.status = "stopping"
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):  # `_guard` already took any other exception
                await task
        try:
            await self.teardown()
        finally:
            if self.nc is not None and not self.nc.is_closed:
                with contextlib.suppress(*BUS_ERRORS):
                    await asyncio.wait_for(self.nc.drain(), timeout=5)
                if not self.nc.is_closed:
                    await self.nc.close()
            self.metrics.close()
            self.log.info("service_stopped")

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """Run a background task owned by the service. Its crash is logged and counted, does not kill the process,
        and makes the service report `unhealthy` (see the module doc)."""
        task = asyncio.create_task(self._guard(coro, name or getattr(coro, "__name__", "task")), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _guard(self, coro: Coroutine[Any, Any, Any], name: str) -> Any:
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Broad on purpose: one task's bug must not end the process; it is logged with its traceback, counted
            # and reported "unhealthy" for as long as the service lives.
            self.metrics.count_error("task")
            self.failed_tasks[name] = repr(exc)[:300]
            self.log.exception("task_failed", task=name, error=repr(exc))
            return None

    def note_bug(
        self, kind: str, exc: BaseException, /, where: str = "", event: str = "", **fields: Any
    ) -> None:
        """Surface our own bug that a deliberately broad catch keeps a loop or a job alive through; call it from
        the `except` block. Logs `event` (default `<kind>_failed`) with the traceback, counts `kind`, and reports
        the service `degraded` until `clear_bug(kind, where)`."""
        self.metrics.count_error(kind)
        self.bugs[f"{kind}:{where}" if where else kind] = repr(exc)[:300]
        self.log.exception(event or f"{kind}_failed", error=repr(exc), **fields)

    def clear_bug(self, kind: str, where: str = "") -> None:
        """The place `note_bug(kind, where)` named succeeded again."""
        if self.bugs:
            self.bugs.pop(f"{kind}:{where}" if where else kind, None)

    @property
    def health_status(self) -> str:
        """What health replies say: `unhealthy` once a background task died, `degraded` while a survived bug is
        current (see `note_bug`), else the service's own status."""
        if self.failed_tasks and self.status != "stopping":
            return "unhealthy"
        if self.bugs and self.status == "ok":
            return "degraded"
        return self.status

    # --- messaging helpers ------------------------------------------------------------------------------------
    async def publish(self, subject: str, msg: Message, reply: str = "") -> None:
        """Raises MessageTooLarge for a message over the server's max_payload (nothing is sent)."""
        assert self.nc is not None
        await self.nc.publish(
            subject, check_size(subject, proto.encode(msg), self.nc.max_payload), reply=reply
        )
        self.metrics.count_out(subject)

    async def js_publish(
        self, subject: str, msg: Message, msg_id: str | None = None, wait_s: float = PUBLISH_WAIT_S
    ) -> None:
        """Publish into a stream; `msg_id` lets JetStream drop a duplicate publish (idempotent retries). A full work
        queue or a server restart is waited out for up to `wait_s` wall seconds (counted as `publish_retry`); then
        the error is raised. Raises MessageTooLarge for a message over the server's max_payload (nothing is sent,
        nothing retried: it would fail every time)."""
        assert self.js is not None and self.nc is not None
        data = check_size(subject, proto.encode(msg), self.nc.max_payload)
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None

        def on_retry(exc: BaseException) -> None:
            self.metrics.count_error("queue_full" if is_queue_full(exc) else "publish_retry")

        await js_publish_patiently(self.js, subject, data, headers, wait_s, on_retry)
        self.metrics.count_out(subject)

    async def receive(self, msg: Msg, expected: Any = None) -> Message | None:
        """Decode an incoming message, or reject it as bad input (see module doc) and return None."""
        self.metrics.count_in(msg.subject)
        try:
            return proto.decode(msg.data, msg.subject, expected)
        except ProtoError as err:
            await self.reject(msg, err.kind, str(err), field=err.field)
            return None

    async def reject(self, msg: Msg, kind: str, error: str, field: str = "", request_id: str = "") -> None:
        """Log, count and answer bad input; a JetStream message is terminated (never redelivered)."""
        self.metrics.count_error(kind)
        self.bad_input += 1
        self.log.warning("bad_input", kind=kind, subject=msg.subject, error=error, field=field)
        reply = ErrorReply(
            kind=kind,
            error=error,
            subject=msg.subject,
            field=field,
            request_id=request_id,
            service=self.instance_id,
            ts_s=self.clock.now_s(),
        )
        target = msg.reply if msg.reply and not _is_js(msg) else self.subjects.errors
        with contextlib.suppress(*BUS_ERRORS):
            await self.publish(target, reply)
        if _is_js(msg):
            with contextlib.suppress(*BUS_ERRORS):
                await msg.term()

    async def subscribe(self, subject: str, handler: Handler, expected: Any = None, queue: str = "") -> None:
        """Core-NATS subscription whose handler only ever sees valid messages, and whose failures are contained."""
        assert self.nc is not None
        self.consumed.append(subject)

        async def cb(msg: Msg) -> None:
            decoded = await self.receive(msg, expected)
            if decoded is None:
                return
            try:
                await handler(decoded, msg)
            except BUS_ERRORS as exc:  # a publish the bus refused (disconnected, restarting): not ours
                self.metrics.count_error("handler_bus")
                self.log.warning("handler_bus_error", subject=msg.subject, error=repr(exc))
            except Exception as exc:
                # Broad on purpose: the handler sees only valid messages, so this is our bug; one message must not
                # silence the subscription, so it is surfaced (logged, counted, in health) and the next one handled.
                self.note_bug("handler", exc, where=subject, subject=msg.subject)
            else:
                self.clear_bug("handler", subject)

        await self.nc.subscribe(subject, queue=queue, cb=cb)

    async def pull_loop(
        self,
        psub: Any,
        handler: Handler,
        expected: Any = None,
        batch: Callable[[], int] | int = 1,
        fetch_timeout_s: float = 0.5,
    ) -> None:
        """Fetch from a JetStream pull subscription until stopped. `batch` may be a callable (capacity-driven pull:
        0 means "no room now"). The handler acks; a handler error naks with a delay so the work is redelivered."""
        while not self.stopping:
            n = batch() if callable(batch) else batch
            if n <= 0:
                await asyncio.sleep(0.01)
                continue
            try:
                msgs = await psub.fetch(n, timeout=fetch_timeout_s)
            except (TimeoutError, NatsTimeoutError):
                continue
            except asyncio.CancelledError:
                raise
            except BUS_ERRORS as exc:  # disconnected, server restarting: back off and retry
                self.metrics.count_error("fetch")
                self.log.debug("fetch_failed", error=repr(exc))
                await asyncio.sleep(0.25)
                continue
            for m in msgs:
                decoded = await self.receive(m, expected)
                if decoded is None:
                    continue
                try:
                    await handler(decoded, m)
                except BUS_ERRORS as exc:  # transient bus trouble: redelivered shortly
                    self.metrics.count_error("handler_bus")
                    self.log.warning("handler_bus_error", subject=m.subject, error=repr(exc))
                except Exception as exc:
                    # Broad on purpose: our bug on one message must not end the pull loop (the consumer would go
                    # idle); it is surfaced (logged, counted, in health) and the message redelivered (max_deliver).
                    self.note_bug("handler", exc, where="pull", subject=m.subject)
                else:
                    self.clear_bug("handler", "pull")
                    continue
                with contextlib.suppress(*BUS_ERRORS):
                    await m.nak(delay=1.0)

    # --- health and loop lag ----------------------------------------------------------------------------------
    async def _on_health(self, msg: Msg) -> None:
        try:
            proto.decode_as(msg.data, HealthRequest, msg.subject)
        except ProtoError as err:
            # Counted, never answered (not even on the errors subject): a reply per service to any bytes would
            # let one message fan out into one per service.
            self.metrics.count_error("health_request")
            self.bad_input += 1
            self.log.debug("bad_health_request", error=str(err))
            return
        if not msg.reply:
            return
        details = {
            "errors": dict(self.metrics.error_counts),
            "bad_input": self.bad_input,
            "messages_in": self.metrics.in_count,
            "messages_out": self.metrics.out_count,
        }
        if self.failed_tasks:
            details["failed_tasks"] = dict(self.failed_tasks)
        if self.bugs:
            details["bugs"] = dict(self.bugs)
        details["consumed"] = sorted(set(self.consumed))  # what the fault campaign floods and expects counted
        details.update(self.health_details())
        reply = HealthReply(
            service=self.name,
            instance_id=self.instance_id,
            status=self.health_status,  # type: ignore[arg-type]
            uptime_s=time.monotonic() - self._started_mono,
            ts_s=self.clock.now_s(),
            details=details,
        )
        with contextlib.suppress(*BUS_ERRORS):
            await self.publish(msg.reply, reply)

    async def _probe_loop_lag(self, interval_s: float = 0.5) -> None:
        """Schedule a wake-up and measure how late it came: a busy or blocked loop shows up here."""
        while True:  # wall seconds: the lag is the event loop's own, whatever the time scale
            t0 = time.monotonic()
            await asyncio.sleep(interval_s)
            self.metrics.observe_lag(max(0.0, time.monotonic() - t0 - interval_s))


def _is_js(msg: Msg) -> bool:
    return bool(msg.reply) and msg.reply.startswith("$JS.ACK")

"""Ask every live service for its health (request to `ns.health`, gather all replies for a moment)."""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlparse

import nats
from nats.errors import NoServersError

import proto
from proto import HealthReply, HealthRequest, ProtoError, Subjects
from services.runtime.bus import connect
from services.runtime.clock import Clock
from services.runtime.credentials import BusCredentials


async def gather_health(
    nats_url: str,
    namespace: str = "prorsa",
    wait_s: float = 1.0,
    credentials: BusCredentials | None = None,
) -> list[HealthReply]:
    """Every HealthReply that arrives within `wait_s` (one per live service instance), sorted by service/instance.
    `credentials`: whom to ask as (default: the PRORSA_NATS_* environment's)."""
    check_reachable(nats_url)

    errors: list[Exception] = []

    async def quiet(exc: Exception) -> None:  # the caller reports failures; no tracebacks from the client
        errors.append(exc)

    try:
        nc = await connect(
            nats_url,
            "prorsa-health",
            credentials=credentials,
            connect_timeout=2,
            max_reconnect_attempts=1,
            error_cb=quiet,
        )
    except NoServersError as exc:  # say why: a refused login reads differently from no server
        raise ConnectionError(f"{exc!r}, last error: {errors[-1] if errors else 'none'}") from exc
    try:
        inbox = nc.new_inbox()
        replies: list[HealthReply] = []

        async def on_reply(msg: nats.aio.msg.Msg) -> None:
            try:
                replies.append(proto.decode_as(msg.data, HealthReply, msg.subject))
            except ProtoError:
                pass  # a peer speaking another version: not counted as healthy

        sub = await nc.subscribe(inbox, cb=on_reply)
        await ask_health(nc, Subjects(namespace).health, inbox)
        await nc.flush()
        await asyncio.sleep(wait_s)
        await sub.unsubscribe()
        return sorted(replies, key=lambda r: (r.service, r.instance_id))
    finally:
        await nc.close()


async def ask_health(nc: nats.aio.client.Client, subject: str, inbox: str) -> None:
    """Publish a HealthRequest on `subject` whose replies go to `inbox`, stamped on the shared scaled clock like
    every message on the bus."""
    await nc.publish(subject, proto.encode(HealthRequest(ts_s=Clock.from_env().now_s())), reply=inbox)


def check_reachable(nats_url: str, timeout_s: float = 2.0) -> None:
    """Fail fast (ConnectionError) when no server listens at any of the URL's addresses."""
    for part in nats_url.split(","):
        u = urlparse(part.strip())
        try:
            socket.create_connection((u.hostname or "127.0.0.1", u.port or 4222), timeout=timeout_s).close()
            return
        except OSError:
            continue
    raise ConnectionError(f"no NATS server listening at {nats_url}")


def format_health(replies: list[HealthReply]) -> str:
    """A plain table of the replies (one line per instance)."""
    if not replies:
        return "no service answered"
    lines = [f"{'service':<20} {'instance':<28} {'status':<9} {'uptime_s':>9}  details"]
    for r in replies:
        details = ", ".join(
            f"{k}={v}" for k, v in sorted(r.details.items()) if k not in ("errors", "consumed")
        )
        errs = r.details.get("errors") or {}
        if errs:
            details += f", errors={errs}"
        lines.append(f"{r.service:<20} {r.instance_id:<28} {r.status:<9} {r.uptime_s:>9.1f}  {details}")
    return "\n".join(lines)

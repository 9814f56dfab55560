"""Token streams survive a nats-server restart: after a reconnect the client reads back what it missed.

Why. Engines stream `TokenChunk`s with core-NATS publishes. While the server restarts, the chunks an engine sends
wait in its client's reconnect buffer and reach the new server when the engine reconnects, which may be before this
client has re-subscribed: core NATS then delivers them to nobody, and a turn whose final chunk was among them waited
out the client's retry timer (minutes) and was computed twice.

How. The server also keeps every chunk on `ns.reply.>` in the REPLIES stream (`services/runtime/bus.py`). A
`ReconnectWatch` notices a reconnect (the connection's reconnect counter moved) and remembers when the connection
was last seen up; `replay()` then reads every chunk stored on this client's reply subjects since shortly before
that moment (an ephemeral consumer, by start time) and feeds them to the client's usual chunk handler, where the
assembler drops what it already has. The replay runs after the reconnect, i.e. after the client's subscriptions
are back, so every chunk is either stored before the replay reads the stream or delivered live afterwards.

What it cannot bring back: a chunk the dying server had received but not stored. A stream left with such a gap gets
no further chunk, so the client retries it at once (`RolloutClient`: a request with an incomplete stream and no
progress for `recover_after_s` after a reconnect); only turns in flight during the outage can be computed twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from proto import Subjects

REPLAY_MARGIN_S = 5.0  # replay from this long before the connection was last seen up (clock skew, buffering)


@dataclass
class ReconnectWatch:
    """Pure: fed the connection's state every poll, says when a reconnect happened and since when to replay."""

    reconnects: int = 0
    last_up_s: float = 0.0  # wall time the connection was last seen connected

    def poll(self, connected: bool, reconnects: int, now: float) -> float | None:
        """The wall time to replay from, when a reconnect happened since the last poll; else None."""
        since = None
        if reconnects != self.reconnects:
            self.reconnects = reconnects
            since = (self.last_up_s or now) - REPLAY_MARGIN_S
        if connected:
            self.last_up_s = now
        return since


async def replay(
    nc: NATS,
    subjects: Subjects,
    reply_prefix: str,
    since_s: float,
    on_data: Callable[[str, bytes], Awaitable[None]],
    batch: int = 512,
) -> int:
    """Feed every chunk stored on `reply_prefix.>` since `since_s` (wall) to `on_data(subject, data)`; returns how
    many. Raises nats errors if the server is not there (the caller tries again at the next reconnect)."""
    js = nc.jetstream()
    start = datetime.datetime.fromtimestamp(max(0.0, since_s), datetime.UTC)
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME,
        opt_start_time=start.isoformat(),
        ack_policy=AckPolicy.NONE,
        filter_subject=f"{reply_prefix}.>",
        inactive_threshold=30.0,  # removed by the server if we die mid-replay
    )
    psub = await js.pull_subscribe(f"{reply_prefix}.>", stream=subjects.replies_stream, config=config)
    n = 0
    try:
        while True:
            try:
                msgs = await psub.fetch(batch, timeout=0.5)
            except (TimeoutError, NatsTimeoutError):
                break
            for m in msgs:
                await on_data(m.subject, m.data)
                n += 1
            if msgs and msgs[-1].metadata.num_pending == 0:
                break
    finally:
        with contextlib.suppress(NatsError):
            await psub.unsubscribe()
    return n


async def watch_reconnects(
    nc: NATS,
    on_reconnect: Callable[[float], Awaitable[None]],
    interval_s: float = 0.1,
) -> None:
    """Poll the connection (wall cadence) and await `on_reconnect(since_s)` after each reconnect."""
    watch = ReconnectWatch(reconnects=int(nc.stats.get("reconnects", 0)))
    while True:
        # Unscaled wall time: it is compared with the server's storage times of the REPLIES stream (`replay`).
        since = watch.poll(nc.is_connected, int(nc.stats.get("reconnects", 0)), time.time())
        if since is not None:
            await on_reconnect(since)
        await asyncio.sleep(interval_s)

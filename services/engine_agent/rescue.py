"""Work addressed to a dead engine moves to the shared queue within seconds: peers notice its stats stop.

Why. A trajectory's next turn is addressed to the engine holding its prefix (`work.prefill.engine.<id>`), and only
that engine's durable consumer (`prefill-<id>`) reads that subject. When the engine dies, the turn it held is
redelivered after `ack_wait` to that same consumer, and the turns clients addressed to it before noticing wait
there too: nobody reads them until an engine of the same id comes back (or the client's own retry fires, minutes
later). Work-queue streams forbid a second consumer with an overlapping filter, so no other engine can simply
listen as well; but anyone may bind the existing durable.

How. Every engine already receives every engine's `EngineStats` (about one per `stats_interval_s`). `PeerWatch`
(pure) calls an engine dead once its stats stop for `dead_after_s` (a few intervals) and names one rescuer for it:
the live engine with the smallest id (every engine computes the same from the same stats; a transient disagreement
only means two rescuers, which is harmless, see below). The rescuer binds the dead engine's addressed durable
(`prefill-<id>`: only prefill work is ever addressed; decode handoffs go to the shared queue) and moves whatever it
holds, now or later, to the shared queue `work.prefill.any`, where any engine takes it; it stops once the engine's
stats are back (a replacement of the same id) or after `forget_after_s`. A moved message is published with the
message id `fwd:<subject>:<stream seq>` before the original is acked, so two rescuers, a lost ack or a redelivery
never duplicate it (JetStream drops the second publish).

Timing. With the defaults (stats every 1 s, dead after 3 s, ack_wait 3 s with in-progress heartbeats every 1 s),
addressed work reaches the shared queue ≤ ~3.5 s after the kill, and the work the dead engine held from the shared
queues is redelivered by JetStream within its ack_wait: both within the 5 s the fault campaign checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NotFoundError

from proto import EngineStats, Message
from services.engine_agent.puller import durable_name
from services.runtime.bus import BUS_ERRORS

PREFILL_ROLES = ("prefill", "mixed")


@dataclass
class PeerWatch:
    """Which peers are dead and which of them this engine rescues. Pure: `now` is wall seconds (monotonic)."""

    me: str
    dead_after_s: float = 3.0
    forget_after_s: float = 600.0  # a peer silent this long is forgotten (and no longer rescued)
    last_seen: dict[str, float] = field(default_factory=dict)
    # What each peer's last stats said: (role, switching). A restarting engine moves a decode to the peer that
    # holds its prefix only while that peer takes prompts (`takes_prompts`, switch_drain.py).
    states: dict[str, tuple[str, bool]] = field(default_factory=dict)

    def observe(self, engine_id: str, now: float, role: str = "", switching: bool = False) -> None:
        self.last_seen[engine_id] = now
        if role:
            self.states[engine_id] = (role, switching)

    def takes_prompts(self, engine_id: str, now: float) -> bool:
        """Whether `engine_id` is alive (stats within `dead_after_s`), prefills (prefill or mixed role) and is not
        switching, by its last stats — what a client checks before addressing a turn to an engine."""
        seen = self.last_seen.get(engine_id)
        role, switching = self.states.get(engine_id, ("", True))
        return (
            seen is not None and now - seen <= self.dead_after_s and role in PREFILL_ROLES and not switching
        )

    def live(self, now: float) -> list[str]:
        alive = {e for e, t in self.last_seen.items() if now - t <= self.dead_after_s}
        return sorted(alive | {self.me})

    def dead(self, now: float) -> list[str]:
        for e in [e for e, t in self.last_seen.items() if now - t > self.forget_after_s]:
            del self.last_seen[e]
            self.states.pop(e, None)
        return sorted(e for e, t in self.last_seen.items() if e != self.me and now - t > self.dead_after_s)

    def to_rescue(self, now: float) -> list[str]:
        """Dead peers whose addressed work this engine moves: all of them if it is the smallest live id."""
        dead = self.dead(now)
        return dead if dead and self.live(now)[0] == self.me else []


class AddressedRescue:
    """The shell: watches stats, binds a dead peer's addressed durables and forwards what they hold."""

    def __init__(
        self, agent: Any, dead_after_s: float, poll_s: float = 0.2, mono: Callable[[], float] = time.monotonic
    ) -> None:
        self.agent = agent
        self.watch = PeerWatch(agent.engine_id, dead_after_s=dead_after_s)
        self.poll_s = poll_s
        self._mono = mono  # wall seconds: stats arrive on a wall cadence, whatever the engine's time scale
        self.errors = 0
        self.subs: dict[str, Any] = {}  # dead engine -> its bound `prefill-<id>` pull subscription
        self.moved = 0  # messages moved to the shared queue
        self.rescued: set[str] = set()  # engines whose work this engine moved at least once

    async def on_stats(self, msg: Message, raw: Any) -> None:
        assert isinstance(msg, EngineStats)
        if raw.subject.rsplit(".", 1)[-1] == msg.engine_id:  # forged stats for another engine are ignored
            self.watch.observe(msg.engine_id, self._mono(), msg.role, msg.switching)

    def takes_prompts(self, engine_id: str) -> bool:
        """`PeerWatch.takes_prompts` now."""
        return self.watch.takes_prompts(engine_id, self._mono())

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)  # wall cadence: it paces I/O
            targets = set(self.watch.to_rescue(self._mono()))
            for engine_id in [e for e in self.subs if e not in targets]:
                await self._unbind(engine_id)
            for engine_id in sorted(targets):
                try:
                    await self._forward(engine_id)
                except NatsError as exc:  # disconnected, or the shared queue is full: next round
                    self.errors += 1
                    self.agent.log.debug("rescue_failed", dead_engine=engine_id, error=repr(exc))

    async def close(self) -> None:
        for engine_id in list(self.subs):
            await self._unbind(engine_id)

    async def _bind(self, engine_id: str) -> Any:
        if engine_id not in self.subs:
            try:
                self.subs[engine_id] = await self.agent.js.pull_subscribe_bind(
                    durable=durable_name("prefill", engine_id), stream=self.agent.subjects.work_stream
                )
            except NotFoundError:
                return None  # that engine never bound its queue: nothing can wait there
        return self.subs[engine_id]

    async def _unbind(self, engine_id: str) -> None:
        psub = self.subs.pop(engine_id)
        with contextlib.suppress(*BUS_ERRORS):  # best effort: the connection may be gone already
            await psub.unsubscribe()

    async def _forward(self, engine_id: str) -> None:
        psub = await self._bind(engine_id)
        if psub is None:
            return
        target = self.agent.subjects.prefill_work_any
        try:
            msgs = await psub.fetch(16, timeout=0.05)
        except (TimeoutError, NatsTimeoutError):
            return
        except NotFoundError:
            self.subs.pop(engine_id, None)
            return
        for m in msgs:
            seq = m.metadata.sequence.stream
            await self.agent.js.publish(target, m.data, headers={"Nats-Msg-Id": f"fwd:{m.subject}:{seq}"})
            await m.ack()
            self.moved += 1
            self.rescued.add(engine_id)
            self.agent.log.info(
                "addressed_work_rescued", dead_engine=engine_id, kind="prefill", stream_seq=seq
            )

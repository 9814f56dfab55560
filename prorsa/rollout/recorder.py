"""Records what the live system did over time, for the report's plots and tables: every engine's role and
throughput (from EngineStats), every role switch (from acks), the forecasts, and the prefill demand (the new tokens
of every submitted turn, from the lifecycle subject)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

import proto
from proto import (
    LIFECYCLE_MESSAGES,
    DemandForecast,
    EngineStats,
    ProtoError,
    RoleSwitchAck,
    Subjects,
    TurnSubmitted,
)


@dataclass
class Recorder:
    stats: list[EngineStats] = field(default_factory=list)
    acks: list[RoleSwitchAck] = field(default_factory=list)
    forecasts: list[DemandForecast] = field(default_factory=list)
    turns: list[TurnSubmitted] = field(default_factory=list)
    bad: int = 0

    async def attach(self, nc: NATS, subjects: Subjects) -> None:
        await nc.subscribe(subjects.all_engine_stats, cb=self._on(EngineStats, self.stats))
        await nc.subscribe(subjects.all_engine_acks, cb=self._on(RoleSwitchAck, self.acks))
        await nc.subscribe(subjects.forecast, cb=self._on(DemandForecast, self.forecasts))
        await nc.subscribe(subjects.lifecycle, cb=self._on_lifecycle)

    def _on(self, cls: type, sink: list):  # noqa: ANN202 - a NATS callback
        async def cb(msg: Msg) -> None:
            try:
                sink.append(proto.decode_as(msg.data, cls, msg.subject))
            except ProtoError:
                self.bad += 1

        return cb

    async def _on_lifecycle(self, msg: Msg) -> None:
        try:
            event = proto.decode(msg.data, msg.subject, LIFECYCLE_MESSAGES)
        except ProtoError:
            self.bad += 1
            return
        if isinstance(event, TurnSubmitted):
            self.turns.append(event)

    @property
    def role_switches(self) -> int:
        return sum(1 for a in self.acks if a.ok)

    def role_timeline(self) -> dict[str, list[tuple[float, str]]]:
        """engine_id → [(ts_s, role)] at each change."""
        out: dict[str, list[tuple[float, str]]] = {}
        for s in sorted(self.stats, key=lambda s: s.ts_s):
            line = out.setdefault(s.engine_id, [])
            if not line or line[-1][1] != s.role:
                line.append((s.ts_s, s.role))
        return out

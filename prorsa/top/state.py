"""The state of `prorsa top`: bus messages in, a view model out. Pure: no I/O, no clock, no rich.

Two clocks, both handed in. `now` (the caller's monotonic seconds, when a message was received or the view is
drawn) says how long ago an engine was last heard from. The bus clock — the `ts_s` of the messages themselves,
which under simulated engines runs `speedup` times faster than the wall — measures demand: the realised demand
over the last `h` seconds is what the messages stamped in (T − h, T] carried, T the newest stamp seen.

Rules:
- the newest `EngineStats` of each engine is its row; an engine silent for `stale_after_s` is shown as stale;
- prefill demand realised = new tokens of the `TurnSubmitted` events stamped in the window, per second; decode
  realised = each engine's reported decode rate averaged over the window, summed over engines;
- the forecast compared with what happened is the one issued closest to T − h (what was predicted for now);
- a message that does not decode (another schema version, malformed) is counted per (subject family, reason) and
  shown; it never stops the view.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from proto import (
    AllocationPlan,
    DemandForecast,
    EngineStats,
    HealthReply,
    LifecycleSnapshot,
    Message,
    ProtoError,
    RoleSwitchAck,
    TurnSubmitted,
)


@dataclass(frozen=True)
class EngineRow:
    engine_id: str
    role: str
    epoch: int
    switching: bool
    running: int  # requests in the running batch
    waiting: int  # requests pulled, not yet running
    in_flight_tokens: int  # tokens still to compute for the work it holds
    kv_used_tokens: int
    kv_capacity_tokens: int
    prefix_cache_tokens: int
    prefix_hit_rate: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    stale: bool  # not heard from for stale_after_s

    @property
    def kv_fraction(self) -> float | None:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else None


@dataclass(frozen=True)
class DemandRow:
    role: str  # "prefill" | "decode"
    horizon_s: float
    next_q: (
        tuple[float, float, float] | None
    )  # newest forecast for the next horizon_s: q10, q50, q90 (tokens/s)
    predicted: float | None  # median forecast made ~horizon_s ago for the last horizon_s (tokens/s)
    realised: (
        float | None
    )  # what happened over the last horizon_s (tokens/s); None until the window is covered


@dataclass(frozen=True)
class PlanRow:
    epoch: int
    policy: str
    reason: str
    roles: dict[str, int]  # role → engines the plan gives it
    age_s: float


@dataclass(frozen=True)
class TopView:
    engines: list[EngineRow]
    demand: list[DemandRow]
    plan: PlanRow | None
    phases: dict[str, int]  # trajectory state → live trajectories (tracker snapshot)
    finished_total: int
    aborted_total: int
    lost_total: int
    prefill_tokens_per_s: float  # summed over fresh engines
    decode_tokens_per_s: float
    switches_acked: int
    services: dict[str, int]  # service → instances that answered health
    problems: list[str]  # bad input seen on the bus, most frequent first
    heard: bool  # anything valid received at all


@dataclass
class TopState:
    stale_after_s: float = 5.0  # wall seconds without stats before an engine is shown stale
    service_ttl_s: float = 25.0  # wall seconds a health reply counts (the shell asks again every ~10 s)
    history_s: float = 120.0  # bus seconds of turns, stats samples and forecasts kept for the demand windows
    engines: dict[str, tuple[EngineStats, float]] = field(default_factory=dict)  # id → (stats, received at)
    plan: tuple[AllocationPlan, float] | None = None
    snapshot: LifecycleSnapshot | None = None
    services: dict[str, dict[str, float]] = field(default_factory=dict)  # service → instance → answered at
    switches_acked: int = 0
    bad: dict[tuple[str, str], int] = field(default_factory=dict)
    bus_s: float = 0.0  # newest message stamp seen (the bus clock)
    _turns: deque[tuple[float, int]] = field(default_factory=deque)  # (ts_s, new tokens)
    _samples: deque[tuple[float, str, float]] = field(
        default_factory=deque
    )  # (ts_s, engine, decode tokens/s)
    _forecasts: deque[DemandForecast] = field(default_factory=deque)
    _first_s: float | None = None  # first bus stamp: the demand windows are covered only after it + h

    # -- in --------------------------------------------------------------------------------------------------

    def apply(self, msg: Message, now: float) -> None:
        """One decoded message received at `now` (caller's monotonic seconds); other types are ignored."""
        if isinstance(msg, EngineStats):
            self.engines[msg.engine_id] = (msg, now)
            self._samples.append((msg.ts_s, msg.engine_id, msg.decode_tokens_per_s))
            self._tick(msg.ts_s)
        elif isinstance(msg, TurnSubmitted):
            self._turns.append((msg.ts_s, msg.new_tokens))
            self._tick(msg.ts_s)
        elif isinstance(msg, DemandForecast):
            self._forecasts.append(msg)
            self._tick(msg.ts_s)
        elif isinstance(msg, AllocationPlan):
            self.plan = (msg, now)
        elif isinstance(msg, LifecycleSnapshot):
            if self.snapshot is None or msg.ts_s >= self.snapshot.ts_s:
                self.snapshot = msg
        elif isinstance(msg, RoleSwitchAck):
            self.switches_acked += int(msg.ok)
        elif isinstance(msg, HealthReply):
            self.services.setdefault(msg.service, {})[msg.instance_id] = now

    def reject(self, subject: str, error: ProtoError) -> None:
        """A message on `subject` that did not decode."""
        family = ".".join(subject.split(".")[:2])
        if error.kind == "schema_version":
            reason = f"a peer speaks another schema version ({error.reason})"
        else:
            reason = f"{error.kind}: {error.field or 'message'}: {error.reason}"
        self.bad[(family, reason)] = self.bad.get((family, reason), 0) + 1

    def _tick(self, ts_s: float) -> None:
        if self._first_s is None or ts_s < self._first_s:
            self._first_s = ts_s
        self.bus_s = max(self.bus_s, ts_s)
        horizon = self.bus_s - self.history_s
        for q in (self._turns, self._samples):
            while q and q[0][0] < horizon:
                q.popleft()
        while self._forecasts and self._forecasts[0].ts_s < horizon:
            self._forecasts.popleft()

    # -- out -------------------------------------------------------------------------------------------------

    def startup_problem(self) -> str | None:
        """After the health probe: why there is nothing to show (None when some service answered)."""
        if self.services:
            return None
        wrong = [reason for (family, reason) in self.bad if reason.startswith("a peer speaks")]
        if wrong:
            return f"services answered, but in another wire format: {wrong[0]}; upgrade one side"
        return "no Prorsa service answered on the bus"

    def view(self, now: float) -> TopView:
        rows = [self._row(s, now - at > self.stale_after_s) for s, at in self.engines.values()]
        rows.sort(key=lambda r: r.engine_id)
        fresh = [r for r in rows if not r.stale]
        snap = self.snapshot
        plan = None
        if self.plan is not None:
            p, at = self.plan
            counts: dict[str, int] = {}
            for role in p.roles.values():
                counts[role] = counts.get(role, 0) + 1
            plan = PlanRow(p.epoch, p.policy, p.reason, counts, now - at)
        return TopView(
            engines=rows,
            demand=self._demand(),
            plan=plan,
            phases=dict(snap.counts) if snap else {},
            finished_total=snap.finished_total if snap else 0,
            aborted_total=snap.aborted_total if snap else 0,
            lost_total=snap.lost_total if snap else 0,
            prefill_tokens_per_s=sum(r.prefill_tokens_per_s for r in fresh),
            decode_tokens_per_s=sum(r.decode_tokens_per_s for r in fresh),
            switches_acked=self.switches_acked,
            services=self._services(now),
            problems=[
                f"{n} × {family}: {reason}"
                for (family, reason), n in sorted(self.bad.items(), key=lambda kv: -kv[1])
            ],
            heard=bool(self.engines or self.snapshot or self.plan or self.services or self._forecasts),
        )

    def _services(self, now: float) -> dict[str, int]:
        counts = {
            name: sum(1 for at in instances.values() if now - at <= self.service_ttl_s)
            for name, instances in sorted(self.services.items())
        }
        return {name: n for name, n in counts.items() if n}

    @staticmethod
    def _row(s: EngineStats, stale: bool) -> EngineRow:
        return EngineRow(
            engine_id=s.engine_id,
            role=s.role,
            epoch=s.epoch,
            switching=s.switching,
            running=s.running,
            waiting=s.waiting,
            in_flight_tokens=s.in_flight_tokens,
            kv_used_tokens=s.kv_used_tokens,
            kv_capacity_tokens=s.kv_capacity_tokens,
            prefix_cache_tokens=s.prefix_cache_tokens,
            prefix_hit_rate=s.prefix_hit_rate,
            prefill_tokens_per_s=s.prefill_tokens_per_s,
            decode_tokens_per_s=s.decode_tokens_per_s,
            stale=stale,
        )

    def _demand(self) -> list[DemandRow]:
        newest = self._forecasts[-1] if self._forecasts else None
        if newest is None or not newest.horizons:
            return []
        h = newest.horizons[0]  # the shortest: what the allocator acts on first
        hs = h.horizon_s
        then = self._forecast_near(self.bus_s - hs, hs)
        return [
            DemandRow(
                role=role,
                horizon_s=hs,
                next_q=(quant.q10 / hs, quant.q50 / hs, quant.q90 / hs) if hs > 0 else None,
                predicted=then[i] if then else None,
                realised=self._realised(role, hs),
            )
            for i, (role, quant) in enumerate((("prefill", h.prefill_tokens), ("decode", h.decode_tokens)))
        ]

    def _forecast_near(self, ts_s: float, horizon_s: float) -> tuple[float, float] | None:
        """(prefill, decode) median rates of the forecast issued closest to `ts_s` for this horizon."""
        best = None
        for f in self._forecasts:
            for h in f.horizons:
                if h.horizon_s != horizon_s or h.horizon_s <= 0:
                    continue
                if best is None or abs(f.ts_s - ts_s) < abs(best[0] - ts_s):
                    best = (f.ts_s, h.prefill_tokens.q50 / h.horizon_s, h.decode_tokens.q50 / h.horizon_s)
        if best is None or abs(best[0] - ts_s) > horizon_s / 2:
            return None
        return best[1], best[2]

    def _realised(self, role: str, horizon_s: float) -> float | None:
        start = self.bus_s - horizon_s
        if self._first_s is None or start < self._first_s or horizon_s <= 0:
            return None
        if role == "prefill":
            return sum(n for ts, n in self._turns if ts > start) / horizon_s
        per_engine: dict[str, list[float]] = {}
        for ts, engine, rate in self._samples:
            if ts > start:
                per_engine.setdefault(engine, []).append(rate)
        return sum(sum(v) / len(v) for v in per_engine.values())

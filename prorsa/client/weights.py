"""The weights barrier and generation control, as a trainer sees them: which engines serve which policy version.

Pure (no I/O, time is a parameter): `WeightsView` keeps what engines report (`WeightsStatus` at every change and
every stats interval, `EngineStats` every second) and answers the two questions `RolloutClient.update_weights`,
`pause` and `resume` ask while they wait: which engines are live, and which of them do not yet do what was asked.

Live. An engine is live while its newest report of either kind (status or stats) is fresh: seen within three of
that kind's own report interval, never longer ago than `stale_after_s` (the rule `EngineDirectory.fresh` applies
to affinity; each kind keeps its own interval, as the two come at different moments of a second). A dead
engine therefore drops out of a barrier after about three missed reports, and one that (re)starts joins it with its
first report, in state "starting", so the barrier names it until it serves the version.

Verdicts (`barrier`): every live engine serves at least the version → done; a live engine reports `failed` for a
version ≥ the one asked and serves an older one → failed (it will not get there without another update); else
waiting, naming the engines that lag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from proto import EngineStats, WeightsStatus


class BarrierError(RuntimeError):
    """Some live engines did not reach the state asked for. `engines`: their ids (sorted); `failed`: engine id →
    the error it reported (an engine that could not load the weights); `timed_out`: the wait ran out."""

    def __init__(
        self, message: str, engines: list[str], failed: dict[str, str] | None = None, timed_out: bool = False
    ) -> None:
        super().__init__(message)
        self.engines = sorted(engines)
        self.failed = dict(failed or {})
        self.timed_out = timed_out


class WeightUpdateError(BarrierError):
    """`update_weights` did not see every live engine serve the version (see `BarrierError` for the fields)."""


class PauseError(BarrierError):
    """`pause` / `resume` did not see every live engine in the state asked for."""


@dataclass(frozen=True, slots=True)
class WeightsAck:
    """Every live engine serves `version` (or a newer one)."""

    version: int
    source: str  # the checkpoint directory ("" = the engines' model path) or "transfer"
    mode: str  # "drain" | "inflight"
    engines: dict[str, int]  # engine id -> the version it serves (≥ version)
    barrier_s: float  # wall seconds from writing the version to the last engine serving it
    revision: int  # the KV revision of the `current` entry that holds this version


@dataclass(frozen=True, slots=True)
class Verdict:
    state: Literal["done", "waiting", "failed"]
    lagging: list[str]  # live engines not there yet (sorted)
    failed: dict[str, str]  # engine id -> error (state "failed")
    served: dict[str, int]  # live engine id -> version it serves


@dataclass
class _Seen:
    at_s: float  # when its newest report arrived (the caller's monotonic clock)
    ts_s: float  # the newest report's own stamp (reordering)
    interval_s: float | None = None  # smoothed gap between reports


@dataclass
class WeightsView:
    stale_after_s: float = 3.0
    missed_intervals: float = 3.0
    min_stale_s: float = 0.5
    status: dict[str, WeightsStatus] = field(default_factory=dict)
    stats_version: dict[str, int] = field(default_factory=dict)
    seen: dict[tuple[str, str], _Seen] = field(default_factory=dict)  # (engine id, "status" | "stats")

    def observe_status(self, msg: WeightsStatus, now: float) -> None:
        prev = self.status.get(msg.engine_id)
        if prev is not None and msg.ts_s < prev.ts_s:
            return  # reordered: keep the newer picture
        self.status[msg.engine_id] = msg
        self._saw((msg.engine_id, "status"), msg.ts_s, now)

    def observe_stats(self, msg: EngineStats, now: float) -> None:
        self.stats_version[msg.engine_id] = msg.policy_version
        self._saw((msg.engine_id, "stats"), msg.ts_s, now)

    def _saw(self, key: tuple[str, str], ts_s: float, now: float) -> None:
        s = self.seen.get(key)
        if s is None:
            self.seen[key] = _Seen(now, ts_s)
            return
        gap = now - s.at_s
        if gap > 0.01:  # a status published at once on a change, then on the tick, is one report
            s.interval_s = gap if s.interval_s is None else 0.8 * s.interval_s + 0.2 * gap
        s.at_s = now
        s.ts_s = max(s.ts_s, ts_s)

    def live(self, now: float) -> list[str]:
        out = set()
        for (engine_id, _), s in self.seen.items():
            bound = self.stale_after_s
            if s.interval_s is not None:
                bound = min(bound, max(self.min_stale_s, self.missed_intervals * s.interval_s))
            if now - s.at_s <= bound:
                out.add(engine_id)
        return sorted(out)

    def served(self, engine_id: str) -> int:
        """The version an engine serves, by its newest status (else its stats)."""
        st = self.status.get(engine_id)
        if st is not None:
            return st.policy_version if st.state != "starting" else -1
        return self.stats_version.get(engine_id, -1)

    def barrier(self, version: int, now: float, since_ts_s: float = float("-inf")) -> Verdict:
        """Where the live engines stand against `version` (see the module doc). A failure counts only when reported
        at or after `since_ts_s` (the report's own stamp): one from before this update was written (a retry of a
        failed version) says nothing about this attempt."""
        live = self.live(now)
        served = {e: self.served(e) for e in live}
        lagging = [e for e in live if served[e] < version]
        failed = {
            e: st.error or "load failed"
            for e in lagging
            if (st := self.status.get(e)) is not None
            and st.state == "failed"
            and st.target_version >= version
            and st.ts_s >= since_ts_s
        }
        if failed:
            return Verdict("failed", lagging, failed, served)
        return Verdict("waiting" if lagging else "done", lagging, {}, served)

    def paused_barrier(self, paused: bool, now: float) -> Verdict:
        """Whether every live engine reports `paused` (only statuses say: stats do not carry it)."""
        live = self.live(now)
        lagging = [e for e in live if (st := self.status.get(e)) is None or st.paused != paused]
        return Verdict("waiting" if lagging else "done", lagging, {}, {e: self.served(e) for e in live})

    def transfer_barrier(self, now: float, since_ts_s: float) -> Verdict:
        """Whether every live engine joined the weight-transfer group (a status stamped at or after `since_ts_s`
        says so); one that reports an error for it fails the wait."""
        live = self.live(now)
        fresh = {e: st for e in live if (st := self.status.get(e)) is not None and st.ts_s >= since_ts_s}
        lagging = [e for e in live if e not in fresh or not fresh[e].transfer_ready]
        failed = {e: st.transfer_error for e, st in fresh.items() if st.transfer_error}
        state: Literal["done", "waiting", "failed"] = (
            "failed" if failed else ("waiting" if lagging else "done")
        )
        return Verdict(state, lagging, failed, {e: self.served(e) for e in live})

"""The trainer's control plane over the bus: weight updates with a barrier, pause/resume, abort by version.

The I/O shell of `weights.py` (whose `WeightsView` decides): `RolloutClient` owns one `PolicyControl` and exposes
its calls (`update_weights`, `pause`, `resume`, `abort_older_than`).

- The current version and the pause flag are keys of the policy KV bucket (`Subjects.policy_bucket`; proto/README.md,
  "Policy versions"). A write is an optimistic update on the key's last revision, so two trainers writing at once
  cannot both win silently (the loser re-reads and, if its version is now below the current one, is refused).
- The barrier watches `WeightsStatus` (`ns.policy.status.*`) and `EngineStats` (`ns.stats.*`) and returns once
  every live engine serves the version; it first waits until the client has listened for one report interval, so an
  engine that reports every second is not missed by a client that has just connected.
- Abort by version is a request on `ns.abort`; every engine answers with the turns it aborted, and the turns of this
  client among them come back with their partial output (their `submit` calls return the same results).

Timers are wall-clock (`time.monotonic`): they bound real waits, whatever the cluster's time scale.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

import proto
from prorsa.client.weights import PauseError, WeightsAck, WeightsView, WeightUpdateError
from proto import (
    MAX_COUNTER,
    POLICY_KEY_CURRENT,
    POLICY_KEY_PAUSED,
    POLICY_KEY_TRANSFER,
    AbortOlderThan,
    AbortOlderThanAck,
    EngineStats,
    GenerationControl,
    PolicyVersionUpdate,
    ProtoError,
    WeightsStatus,
    WeightTransferInit,
)
from services.runtime.bus import policy_bucket
from services.runtime.logging import get_logger

if TYPE_CHECKING:
    from prorsa.client.client import RolloutClient
    from prorsa.client.stream import GenerateResult

log = get_logger("rollout_client", "control")

MODES = ("drain", "inflight")
# Wall seconds the client listens to engine reports before it trusts its picture of the live engines (engines report
# every second by default: `AgentConfig.stats_interval_s`).
DISCOVERY_S = 1.5
POLL_S = 0.05  # the longest a waiting barrier sleeps between two looks (it wakes at every report)
ABORT_ACK_WAIT_S = 1.0  # how long abort_older_than waits for the engines' answers at most
MAX_SOURCE_LEN = 4096


class PolicyControl:
    def __init__(self, client: RolloutClient) -> None:
        self.client = client
        self.view = WeightsView()
        self._changed = asyncio.Event()
        self._listening_since: float | None = None
        self._kv: Any = None
        self.bad_messages = 0

    async def start(self) -> None:
        nc = self.client.nc
        self.client._subs.append(
            await nc.subscribe(self.client.subjects.all_policy_status, cb=self._on_status)
        )
        self._listening_since = time.monotonic()

    def on_stats(self, stats: EngineStats) -> None:
        """Called by the client for every EngineStats it reads (it already subscribes to them)."""
        self.view.observe_stats(stats, time.monotonic())
        self._changed.set()

    async def _on_status(self, msg: Msg) -> None:
        try:
            status = proto.decode_as(msg.data, WeightsStatus, msg.subject)
        except ProtoError:
            self.bad_messages += 1
            return
        self.view.observe_status(status, time.monotonic())
        self._changed.set()

    async def kv(self) -> Any:
        if self._kv is None:
            self._kv = await policy_bucket(self.client.js, self.client.subjects)
        return self._kv

    # -- the current version -------------------------------------------------------------------------------------

    async def current(self) -> tuple[PolicyVersionUpdate | None, int]:
        """The durable current version (None: never set) and its KV revision (0: none)."""
        kv = await self.kv()
        try:
            entry = await kv.get(POLICY_KEY_CURRENT)
        except KeyNotFoundError:
            return None, 0
        try:
            return proto.decode_as(entry.value or b"", PolicyVersionUpdate, "policy.current"), int(
                entry.revision
            )
        except ProtoError as exc:  # a foreign writer put garbage there: overwrite it, say so
            log.warning("policy_current_unreadable", error=str(exc))
            return None, int(entry.revision)

    async def write_version(self, update: PolicyVersionUpdate) -> int:
        """Put `update` as the current version; its KV revision. Raises ValueError when the current version is
        newer (another trainer got there first)."""
        kv = await self.kv()
        while True:
            current, revision = await self.current()
            if current is not None and current.version > update.version:
                raise ValueError(
                    f"policy version {update.version} is below the current version {current.version} "
                    f"(from {current.weights_path or 'the model path'!r}): versions only grow"
                )
            try:
                return int(await kv.update(POLICY_KEY_CURRENT, proto.encode(update), last=revision))
            except KeyWrongLastSequenceError:  # another writer in between: read again, decide again
                continue

    async def update_weights(
        self, version: int, source: str, timeout_s: float, mode: str, transfer: dict[str, Any] | None = None
    ) -> WeightsAck:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not 0 <= version <= MAX_COUNTER:
            raise ValueError(f"policy version must be in [0, 2^53 - 1], got {version}")
        if len(source) > MAX_SOURCE_LEN or "\x00" in source:
            raise ValueError("source must be a path of at most 4096 characters without NUL")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        clock = self.client.clock
        update = PolicyVersionUpdate(
            version=version,
            ts_s=clock.now_s(),
            weights_path=source,
            mode=mode,  # type: ignore[arg-type]
            # Drain at most as long as the caller waits: past it, engines update in flight (versions stamped).
            drain_timeout_s=timeout_s * clock.time_scale,
            transfer=transfer,
        )
        t0 = time.monotonic()
        written_ts = clock.now_s()
        revision = await self.write_version(update)
        log.info("weights_update_written", version=version, source=source, mode=mode, revision=revision)
        verdict = await self._wait(lambda now: self.view.barrier(version, now, written_ts), t0 + timeout_s)
        if verdict.state == "done":
            what = "transfer" if transfer is not None else source
            return WeightsAck(version, what, mode, verdict.served, time.monotonic() - t0, revision)
        if verdict.state == "failed":
            raise WeightUpdateError(
                f"policy version {version}: engines {', '.join(sorted(verdict.failed))} failed to load it "
                f"({'; '.join(f'{e}: {err}' for e, err in sorted(verdict.failed.items()))})",
                verdict.lagging,
                verdict.failed,
            )
        raise WeightUpdateError(
            f"policy version {version}: after {timeout_s:g} s engines {', '.join(verdict.lagging)} do not serve it "
            f"(they serve {', '.join(f'{e}: v{verdict.served[e]}' for e in verdict.lagging)}; -1: starting)",
            verdict.lagging,
            timed_out=True,
        )

    async def _wait(self, judge: Any, deadline: float) -> Any:
        """Wait until `judge(now)` says done or failed, or `deadline` (wall) passes; the last verdict."""
        assert self._listening_since is not None, "PolicyControl.start() first"
        while True:
            now = time.monotonic()
            listened = now - self._listening_since >= DISCOVERY_S
            verdict = judge(now)
            if (listened and verdict.state == "done") or verdict.state == "failed" or now >= deadline:
                return verdict
            self._changed.clear()
            wait = min(POLL_S, max(0.0, deadline - now))
            if not listened:
                wait = min(max(wait, 0.01), DISCOVERY_S - (now - self._listening_since))
            try:
                await asyncio.wait_for(self._changed.wait(), max(wait, 0.001))
            except TimeoutError:
                pass

    async def init_weight_transfer(
        self, init_info: dict[str, Any], rank_offsets: dict[str, int], timeout_s: float
    ) -> list[str]:
        """Have every engine join the trainer's weight-transfer group (key `transfer`); the engines that did, once
        every live one did. The trainer opens its own end meanwhile (NCCL: the rendezvous needs both)."""
        kv = await self.kv()
        t0 = time.monotonic()
        written_ts = self.client.clock.now_s()
        init = WeightTransferInit(init_info=dict(init_info), ts_s=written_ts, rank_offsets=dict(rank_offsets))
        await kv.put(POLICY_KEY_TRANSFER, proto.encode(init))
        verdict = await self._wait(lambda now: self.view.transfer_barrier(now, written_ts), t0 + timeout_s)
        if verdict.state != "done":
            raise WeightUpdateError(
                f"weight transfer: engines {', '.join(verdict.lagging)} did not join"
                + (
                    f" ({'; '.join(f'{e}: {x}' for e, x in sorted(verdict.failed.items()))})"
                    if verdict.failed
                    else ""
                ),
                verdict.lagging,
                verdict.failed,
                timed_out=verdict.state == "waiting",
            )
        return sorted(verdict.served)

    # -- pause / resume ------------------------------------------------------------------------------------------

    async def set_paused(self, paused: bool, reason: str, timeout_s: float) -> list[str]:
        kv = await self.kv()
        t0 = time.monotonic()
        control = GenerationControl(paused=paused, ts_s=self.client.clock.now_s(), reason=reason)
        await kv.put(POLICY_KEY_PAUSED, proto.encode(control))
        log.info("generation_paused" if paused else "generation_resumed", reason=reason)
        verdict = await self._wait(lambda now: self.view.paused_barrier(paused, now), t0 + timeout_s)
        if verdict.state != "done":
            what = "pause" if paused else "resume"
            raise PauseError(
                f"after {timeout_s:g} s engines {', '.join(verdict.lagging)} did not {what}",
                verdict.lagging,
                timed_out=True,
            )
        return sorted(verdict.served)

    # -- abort by version ----------------------------------------------------------------------------------------

    async def abort_older_than(self, version: int, reason: str, timeout_s: float) -> list[GenerateResult]:
        if not 0 <= version <= MAX_COUNTER:
            raise ValueError(f"policy version must be in [0, 2^53 - 1], got {version}")
        client = self.client
        pending = dict(client._pending)  # the futures outlive their entries (submit pops them when done)
        inbox = client.nc.new_inbox()
        acks: list[AbortOlderThanAck] = []
        got = asyncio.Event()

        async def on_ack(msg: Msg) -> None:
            try:
                acks.append(proto.decode_as(msg.data, AbortOlderThanAck, msg.subject))
            except ProtoError:
                self.bad_messages += 1
                return
            got.set()

        sub = await client.nc.subscribe(inbox, cb=on_ack)
        try:
            request = AbortOlderThan(older_than=version, ts_s=client.clock.now_s(), reason=reason)
            await client.nc.publish(client.subjects.abort, proto.encode(request), reply=inbox)
            deadline = time.monotonic() + ABORT_ACK_WAIT_S
            live = set(self.view.live(time.monotonic()))
            while time.monotonic() < deadline and not live <= {a.engine_id for a in acks}:
                got.clear()
                try:
                    await asyncio.wait_for(got.wait(), max(0.001, deadline - time.monotonic()))
                except TimeoutError:
                    pass
        finally:
            await sub.unsubscribe()
        aborted = sorted({rid for a in acks for rid in a.request_ids})
        mine = [pending[rid] for rid in aborted if rid in pending]
        log.info(
            "aborted_older_than", older_than=version, turns=len(aborted), mine=len(mine), engines=len(acks)
        )
        done = await asyncio.wait_for(
            asyncio.gather(*(asyncio.shield(p.done) for p in mine), return_exceptions=True), timeout_s
        )
        return [r for r in done if not isinstance(r, BaseException)]

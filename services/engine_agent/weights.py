"""The engine's weights and generation control on the bus: the I/O shell of `weights_core.py`.

- Start: `start()` reads the policy KV bucket (current version, pause flag) before the agent pulls any work, and
  loads the current version then, so an engine that starts or restarts never serves older weights than the cluster
  (nothing runs yet, so there is nothing to drain). Meanwhile it reports `starting` (the weights barrier names it).
- Updates: the bucket is watched (and re-read every `REREAD_S`, in case a watch missed one); an update on the core
  subject `ns.policy.version` is taken the same way. One load at a time, the newest target last: "drain" stops
  pulling and waits for held turns (at most the update's `drain_timeout_s`, scaled seconds), "inflight" does not;
  both load between two engine steps (`Backend.reload_weights` / `receive_weights`), with running turns frozen.
- Pause: the bucket's `paused` key; the puller stops and the backend freezes its running turns.
- Tensors: the bucket's `transfer` key (`WeightTransferInit`): join the trainer's weight-transfer group (in its own
  task: NCCL's rendezvous waits for the trainer), then updates with `transfer` receive tensors instead.
- Status: a `WeightsStatus` at every change and every stats interval on `ns.policy.status.<engine_id>`.
- Abort by version: `abort_older_than` aborts the turns older than the bound and answers with their ids.

Every bad update is answered (ErrorReply on its reply subject or `ns.errors`), logged and counted; a load that
fails leaves the old weights serving and says why in the status.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from nats.js.errors import KeyNotFoundError

import proto
from proto import (
    POLICY_KEY_CURRENT,
    POLICY_KEY_PAUSED,
    POLICY_KEY_TRANSFER,
    AbortOlderThan,
    AbortOlderThanAck,
    GenerateRequest,
    GenerationControl,
    Message,
    PolicyVersionUpdate,
    ProtoError,
    WeightTransferInit,
)
from services.engine_agent import weights_core as core
from services.engine_agent.backend import BackendError
from services.engine_agent.weights_guard import resolve
from services.runtime.bus import BUS_ERRORS, policy_bucket

if TYPE_CHECKING:
    from services.engine_agent.agent import EngineAgent

REREAD_S = 10.0  # wall seconds between two reads of the bucket besides the watch (a missed update is caught)
DRAIN_POLL_S = 0.02  # wall seconds between two looks at the held turns while draining
LATER_DELAY_MIN_S = 0.25  # a turn that needs a version still loading is redelivered after this (doubling)
LATER_DELAY_MAX_S = 5.0


def later_delay_s(deliveries: int) -> float:
    """Redelivery delay of a turn waiting for a version, on its `deliveries`-th delivery: 0.25 s doubling to 5 s, so
    the work queue's delivery bound (20) covers about a minute and a half of loading."""
    return min(LATER_DELAY_MAX_S, LATER_DELAY_MIN_S * 2.0 ** min(max(deliveries, 1) - 1, 16))


class WeightsControl:
    def __init__(self, agent: EngineAgent) -> None:
        self.agent = agent
        self.state = core.WeightsState()
        self._kv: Any = None
        self._wake = asyncio.Event()  # a new target to load
        self._task: asyncio.Task[Any] | None = None
        self.loads = 0
        self.refused = 0
        self._transfer_revision = 0  # the `transfer` entry joined (or being joined)

    # -- start-up ------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Before pulling: read the bucket, load the current version, apply the pause flag; then watch. Raises
        BackendError when the current version cannot be loaded (the engine must not serve older weights), and
        BUS_ERRORS when the bucket cannot be read."""
        agent = self.agent
        assert agent.js is not None
        self._kv = await policy_bucket(agent.js, agent.subjects)
        await self._read_bucket()
        if self.state.wants_load:
            update = self.state.target
            assert update is not None
            agent.log.info("weights_load_at_start", version=update.version, path=update.weights_path)
            await self._load(update, drain=False)
            if self.state.phase == "failed":
                raise BackendError(
                    f"engine {agent.engine_id} cannot load the current policy version {update.version}: "
                    f"{self.state.error}"
                )
        self.state = core.started(self.state)
        await self.publish_status()
        agent.spawn(self._watch(), name="weights_watch")
        agent.spawn(self._reread_loop(), name="weights_reread")
        self._task = agent.spawn(self._apply_loop(), name="weights")

    async def _read_bucket(self) -> None:
        for key in (POLICY_KEY_PAUSED, POLICY_KEY_TRANSFER, POLICY_KEY_CURRENT):
            try:
                entry = await self._kv.get(key)
            except KeyNotFoundError:
                continue
            await self._on_entry(key, entry.value or b"", int(entry.revision))

    async def _watch(self) -> None:
        """Follow the bucket; a watch that breaks (server restart, consumer gone) is made again."""
        while True:
            try:
                watcher = await self._kv.watchall()
                async for entry in watcher:
                    if entry is None:  # the end of the initial values
                        continue
                    if entry.value is None or entry.operation is not None:
                        continue  # a delete or purge: the last value stands (versions only grow)
                    await self._on_entry(entry.key, entry.value, int(entry.revision))
            except BUS_ERRORS as exc:
                self.agent.metrics.count_error("weights_watch")
                self.agent.log.warning("weights_watch_failed", error=repr(exc))
                await asyncio.sleep(1.0)

    async def _reread_loop(self) -> None:
        while True:
            await asyncio.sleep(REREAD_S)
            with contextlib.suppress(*BUS_ERRORS):
                await self._read_bucket()

    async def _on_entry(self, key: str, value: bytes, revision: int) -> None:
        subject = f"$KV.{self.agent.subjects.policy_bucket}.{key}"
        try:
            if key == POLICY_KEY_CURRENT:
                await self.on_update(proto.decode_as(value, PolicyVersionUpdate, subject), revision, None)
            elif key == POLICY_KEY_PAUSED:
                await self.set_paused(proto.decode_as(value, GenerationControl, subject))
            elif key == POLICY_KEY_TRANSFER and revision != self._transfer_revision:
                self._transfer_revision = revision
                init = proto.decode_as(value, WeightTransferInit, subject)
                self.agent.spawn(self._join_transfer(init), name="weights_transfer_init")
        except (
            ProtoError
        ) as exc:  # a writer with the right to write put garbage there: counted, never applied
            self.refused += 1
            self.agent.metrics.count_error(exc.kind)
            self.agent.bad_input += 1
            self.agent.log.warning("bad_policy_entry", key=key, error=str(exc))
            with contextlib.suppress(*BUS_ERRORS):
                await self.agent.publish(
                    self.agent.subjects.errors,
                    proto.ErrorReply(
                        kind=exc.kind,
                        error=str(exc),
                        subject=subject,
                        field=exc.field,
                        service=self.agent.instance_id,
                        ts_s=self.agent.clock.now_s(),
                    ),
                )

    # -- updates -------------------------------------------------------------------------------------------------

    async def on_core_update(self, msg: Message, raw: Any) -> None:
        """A PolicyVersionUpdate on `ns.policy.version` (not durable: the bucket is)."""
        assert isinstance(msg, PolicyVersionUpdate)
        await self.on_update(msg, 0, raw)

    async def on_update(self, update: PolicyVersionUpdate, revision: int, raw: Any) -> None:
        cfg = self.agent.config
        self.state, d = core.on_update(self.state, update, revision, cfg.max_version_jump, cfg.weights_root)
        if d.kind == "refuse":
            assert d.refusal is not None
            self.refused += 1
            field = "version" if d.refusal.kind == "version_jump" else "weights_path"
            if raw is not None:
                await self.agent.reject(raw, d.refusal.kind, d.refusal.error, field=field)
            else:
                self.agent.metrics.count_error(d.refusal.kind)
                self.agent.bad_input += 1
                self.agent.log.warning("weights_update_refused", kind=d.refusal.kind, error=d.refusal.error)
            await self.publish_status()
            return
        if d.kind == "load":
            self.agent.log.info("weights_update", version=update.version, mode=update.mode, revision=revision)
            self._wake.set()
            await self.publish_status()

    async def _apply_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.state.wants_load:
                update = self.state.target
                assert update is not None
                # Paused by the trainer (pause, update, resume: AReaL's pattern), held turns are frozen and would
                # never drain: load at once; they go on under the new weights after the resume, tokens stamped.
                await self._load(update, drain=update.mode == "drain" and not self.state.paused)

    async def _load(self, update: PolicyVersionUpdate, drain: bool) -> None:
        """Drain (optionally), then load `update` between two engine steps; the outcome goes into the state."""
        agent = self.agent
        self.state = core.loading(self.state, drain)
        await self.publish_status()
        if drain:
            agent.puller.pause("weights")
        try:
            if drain:
                await agent.puller.wait_idle()
                deadline_s = agent.clock.monotonic_s() + update.drain_timeout_s
                while agent.runner.jobs and agent.clock.monotonic_s() < deadline_s:
                    await asyncio.sleep(DRAIN_POLL_S)
                if agent.runner.jobs:
                    agent.log.warning(
                        "weights_drain_timed_out", version=update.version, held=len(agent.runner.jobs)
                    )
                self.state = core.loading(self.state, False)
                await self.publish_status()
            t0 = agent.clock.monotonic_s()
            async with agent.reconfig_lock:
                if update.transfer is not None:
                    await agent.backend.receive_weights(update.version, update.transfer)
                else:
                    path = resolve(update.weights_path, agent.config.weights_root)
                    await agent.backend.reload_weights(update.version, path)
            load_s = agent.clock.monotonic_s() - t0
            self.loads += 1
            self.state = core.loaded(self.state, update.version, load_s)
            agent.log.info("weights_updated", version=update.version, load_s=round(load_s, 3))
        except BackendError as exc:  # the engine could not load them: the old weights serve on
            agent.metrics.count_error("weights")
            agent.log.error("weights_update_failed", version=update.version, error=repr(exc))
            self.state = core.failed(self.state, update.version, str(exc))
        finally:
            if drain:
                agent.puller.resume("weights")
        await self.publish_status()

    async def _join_transfer(self, init: WeightTransferInit) -> None:
        """Join the trainer's weight-transfer group; the outcome goes into the status."""
        agent = self.agent
        info = dict(init.init_info)
        if init.rank_offsets:
            offset = init.rank_offsets.get(agent.engine_id)
            if offset is None:
                self.state = replace(
                    self.state, transfer_ready=False, transfer_error="no rank offset for this engine"
                )
                await self.publish_status()
                return
            info["rank_offset"] = offset
        self.state = replace(self.state, transfer_ready=False, transfer_error="")
        try:
            await agent.backend.init_weight_transfer(info)
        except BackendError as exc:
            agent.metrics.count_error("weights_transfer")
            agent.log.error("weights_transfer_join_failed", error=repr(exc))
            self.state = replace(self.state, transfer_error=str(exc)[:500])
        else:
            agent.log.info("weights_transfer_joined", rank_offset=info.get("rank_offset"))
            self.state = replace(self.state, transfer_ready=True)
        await self.publish_status()

    # -- pause ---------------------------------------------------------------------------------------------------

    async def set_paused(self, control: GenerationControl) -> None:
        if control.paused == self.state.paused:
            return
        self.state = replace(self.state, paused=control.paused)
        agent = self.agent
        if control.paused:
            agent.puller.pause("trainer")
            await agent.backend.pause_generation("trainer")
        else:
            await agent.backend.resume_generation("trainer")
            agent.puller.resume("trainer")
        agent.log.info("generation_paused" if control.paused else "generation_resumed", reason=control.reason)
        await self.publish_status()

    async def release(self) -> None:
        """At stop: lift the trainer's pause on the backend, so the turns it froze can be stopped and handed on
        (they wait in the queue for the cluster's resume like any other)."""
        if self.state.paused:
            await self.agent.backend.resume_generation("trainer")

    # -- turns ---------------------------------------------------------------------------------------------------

    async def admit(self, request: GenerateRequest) -> core.Admission:
        """Whether a pulled turn may run here now. Before calling a turn unavailable, the bucket is read again: the
        trainer may have written a version this engine has not heard of yet."""
        decision = core.admit(self.state, request)
        if decision == "unavailable" and self._kv is not None:
            with contextlib.suppress(*BUS_ERRORS):
                await self._read_bucket()
            decision = core.admit(self.state, request)
        return decision

    def unavailable_error(self, request: GenerateRequest) -> str:
        return core.unavailable_error(self.state, request)

    async def on_abort_older(self, msg: Message, raw: Any) -> None:
        assert isinstance(msg, AbortOlderThan)
        bound = msg.older_than
        self.state = replace(self.state, abort_below=max(self.state.abort_below, bound))
        aborted = await self.agent.runner.abort_older_than(bound, self.state.served)
        self.agent.log.info("aborted_older_than", older_than=bound, turns=len(aborted))
        if raw is not None and raw.reply:
            ack = AbortOlderThanAck(
                engine_id=self.agent.engine_id,
                older_than=bound,
                request_ids=aborted,
                ts_s=self.agent.clock.now_s(),
            )
            with contextlib.suppress(*BUS_ERRORS):
                await self.agent.publish(raw.reply, ack)

    # -- status --------------------------------------------------------------------------------------------------

    async def publish_status(self) -> None:
        agent = self.agent
        if agent.nc is None or not agent.nc.is_connected:
            return
        with contextlib.suppress(*BUS_ERRORS):
            await agent.publish(
                agent.subjects.policy_status(agent.engine_id),
                core.status(self.state, agent.engine_id, agent.clock.now_s()),
            )

    async def status_loop(self, interval_s: float) -> None:
        """Every stats interval (wall): the barrier sees a live engine even when nothing changes."""
        while True:
            await self.publish_status()
            await asyncio.sleep(interval_s)

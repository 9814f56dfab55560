"""Pulls work for the engine's role from the JetStream WORK queue, only as much as the engine can take now.

Consumers. WORK is a work-queue stream, so no two consumers may have overlapping filter subjects. Every engine
binds the same three durables: the shared `prefill-any` / `decode-any` (filters `work.prefill.any`,
`work.decode.any`; JetStream hands each message to exactly one of the engines fetching) and its own `prefill-<id>`
for prompts addressed to it (prefix affinity). Decode handoffs are never addressed to one engine: prefill engines
publish them to the shared queue and decode engines pull them by capacity. The first engine to bind a durable
creates it with this engine's `ack_wait`, so all engines of one deployment should use the same value.

Latency. Each of the three queues has its own loop, and the loops long-poll concurrently, each fetching one
message at a time: a message is handed to the engine the moment the server has it, whichever queue it lands on.
(A serial round of "own queue, then shared queue" let addressed work wait out the shared queue's long poll, and a
fetch of more than one message waits until its batch is full or its poll ends before returning any: both cost up to
a poll interval per hop, which a time-scaled simulated engine multiplies by its speed-up.) Each loop checks the
engine's room before fetching, so the two prefill loops can overshoot it by one message at most. A loop without
room sleeps until the runner frees some (`JobRunner.freed`).

Preference. A mixed engine also takes decode handoffs, but only while it holds no prompt to prefill, with a short
poll, and after a poll that found none, not again for `decode_check_s`.

Addressed work on a decode engine. A decode engine does not prefill: its switch moves the prompts addressed to it
to the shared queue (`forward_addressed`), and its own-queue loop keeps forwarding any that land there later (a
client that read its stats before the switch), so none waits for the client's retry.

Pausing. A role switch or a weight update pauses pulling; `wait_idle()` returns once no fetch is in flight, so no
message of the old role can arrive after a restarting switch decided what to drain. An in-place switch does not
wait: a fetch still in flight may deliver a message of a kind the new role does not run (a prompt to an engine now
decoding), which goes straight back to its queue (`nak`, no delay) for an engine that runs it — or, addressed to
this engine, to its own-queue loop, which forwards it. A fetch always runs to its end (never cancelled), so no
pull request lingers on the server to deliver a message nobody reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig

from proto import DecodeHandoff, GenerateRequest, Subjects
from services.engine_agent.measured_capacity import PreemptionGate, measured_held
from services.engine_agent.pull_capacity import EngineLimits, PullConfig, WorkKind, pull_size, takes
from services.engine_agent.runner import JobRunner
from services.runtime.bus import BUS_ERRORS, WORK_MAX_DELIVER

# The queues an engine pulls, as (kind, own): only prefill work is ever addressed to one engine.
QUEUES: tuple[tuple[WorkKind, bool], ...] = (("prefill", True), ("prefill", False), ("decode", False))


def durable_name(kind: WorkKind, engine_id: str | None) -> str:
    """Durable consumer name: "<kind>-any", or "<kind>-<engine id>" (':' is not safe in every client)."""
    return f"{kind}-{'any' if engine_id is None else engine_id.replace(':', '_')}"


# A forward that cannot store its prompt (the stream refuses or times out, as while a server restarts) leaves it in
# this engine's queue and retries after a backoff: an immediate nak would spend the message's `WORK_MAX_DELIVER`
# deliveries in a tight loop within a second, after which JetStream stops delivering it and the turn waits for the
# client's retry (`retry_after_s`). 0.5 s doubling to 10 s rides out ~2.5 minutes of refusals.
FORWARD_RETRY_S = 0.5
FORWARD_RETRY_MAX_S = 10.0


def forward_retry_delay_s(deliveries: int | None) -> float:
    """Seconds before a prompt whose forward failed on its `deliveries`-th delivery is delivered again."""
    n = max(1, deliveries or 1)
    return min(FORWARD_RETRY_MAX_S, FORWARD_RETRY_S * 2.0 ** min(n - 1, 16))


class WorkPuller:
    def __init__(self, agent: Any, runner: JobRunner, config: PullConfig) -> None:
        self.agent = agent
        self.runner = runner
        self.config = config
        self.subs: dict[tuple[WorkKind, bool], Any] = {}  # (kind, own) in QUEUES -> pull subscription
        self._pause_reasons: set[str] = set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._fetching = 0  # fetches in flight, over all loops
        self._last_decode_check = 0.0  # scaled monotonic seconds
        self.fetch_errors = 0
        self.returned = 0  # messages given back: fetched for a role the engine left before they arrived
        self.preemption_gate = PreemptionGate()

    def subject(self, kind: WorkKind, own: bool) -> str:
        s: Subjects = self.agent.subjects
        if kind == "prefill":
            return s.prefill_work_for(self.agent.engine_id) if own else s.prefill_work_any
        if own:
            raise ValueError("decode handoffs are never addressed to one engine")
        return s.decode_work_any

    async def setup(self) -> None:
        """Bind (or create) the three durable consumers of `QUEUES`."""
        js = self.agent.js
        for kind, own in QUEUES:
            subject = self.subject(kind, own)
            durable = durable_name(kind, self.agent.engine_id if own else None)
            config = ConsumerConfig(
                durable_name=durable,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=self.config.ack_wait_s,
                max_ack_pending=self.config.max_ack_pending,
                max_deliver=WORK_MAX_DELIVER,
                filter_subject=subject,
            )
            self.subs[(kind, own)] = await js.pull_subscribe(
                subject, durable=durable, stream=self.agent.subjects.work_stream, config=config
            )
            self.agent.consumed.append(subject)

    async def addressed_backlog(self) -> int:
        """Prompts addressed to this engine and not pulled yet (its own prefill consumer's pending count): clients
        read it in EngineStats before sending a trajectory's turn here (`prorsa.client.directory`)."""
        psub = self.subs.get(("prefill", True))
        if psub is None:
            return 0
        info = await psub.consumer_info()
        return int(info.num_pending or 0)

    async def close(self) -> None:
        """Unsubscribe the pull subscriptions (before the connection drains: a pull inbox can hold late status
        messages that no fetch will read, and draining would wait for them). Unacked work stays in the stream."""
        for psub in self.subs.values():
            with contextlib.suppress(*BUS_ERRORS):
                await psub.unsubscribe()
        self.subs.clear()

    # -- pausing -------------------------------------------------------------------------------------------------

    def pause(self, reason: str) -> None:
        self._pause_reasons.add(reason)
        self._resumed.clear()

    def resume(self, reason: str) -> None:
        self._pause_reasons.discard(reason)
        if not self._pause_reasons:
            self._resumed.set()
            self.runner.freed.set()  # the role may have changed: loops waiting for room look again

    @property
    def paused(self) -> bool:
        return bool(self._pause_reasons)

    async def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Wait until no fetch is in flight (call after `pause`; bounded: a stuck fetch must not stall a switch)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)

    # -- the loops -----------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """One loop per queue of `QUEUES`: own prefill, shared prefill, shared decode."""
        await asyncio.gather(*(self._queue_loop(kind, own) for kind, own in QUEUES))

    async def _queue_loop(self, kind: WorkKind, own: bool) -> None:
        where = durable_name(kind, self.agent.engine_id if own else None)  # names this loop in health
        while True:
            if self._pause_reasons:
                await self._resumed.wait()
                continue
            role = self.agent.role
            poll_s = self._poll_s(kind)
            # A decode engine never prefills, but a client that read its stats before a switch may still address
            # a prompt to it: forward whatever lands there to the shared queue at once (not at the client's retry).
            forward = own and role == "decode"
            if poll_s is None or (not forward and self._capacity(kind) <= 0):
                await self._wait_for_room()
                continue
            self._fetching += 1
            self._idle.clear()
            try:
                took = await (self._forward(poll_s) if forward else self._fetch(kind, own, 1, poll_s))
                if took and kind == "decode" and role == "mixed":
                    self._last_decode_check = -math.inf  # handoffs are waiting: take the next one now
            except Exception as exc:
                # Broad on purpose: `_fetch` handles the bus and bad input itself, so this is our bug, and a dead
                # pull loop would idle the engine. Surfaced (logged, counted, in health); an unacked message is
                # redelivered after ack_wait.
                self.agent.note_bug("pull", exc, where=where, kind=kind, own=own)
                await asyncio.sleep(0.01)
            else:
                self.agent.clear_bug("pull", where)
            finally:
                self._fetching -= 1
                if self._fetching == 0:
                    self._idle.set()

    def _poll_s(self, kind: WorkKind) -> float | None:
        """How long this kind's next fetch may wait for a message; None: do not fetch it now."""
        role = self.agent.role
        if not (role == "mixed" and kind == "decode"):
            return self.config.any_poll_s
        # A mixed engine takes handoffs only with no prompt of its own to prefill, at most every decode_check_s
        # (a wall interval; the clock reads scaled seconds, hence converted).
        clock = self.agent.clock
        since_s = clock.monotonic_s() - self._last_decode_check
        if clock.wall_s(since_s) < self.config.decode_check_s or self.runner.held().prefill_jobs:
            return None
        self._last_decode_check = clock.monotonic_s()
        return self.config.own_poll_s

    async def _wait_for_room(self) -> None:
        """Sleep until the runner frees room or a role changes (or `room_wait_s` passes)."""
        freed = self.runner.freed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(freed.wait(), self.config.room_wait_s)
        freed.clear()

    def _capacity(self, kind: WorkKind) -> int:
        stats = self.agent.backend.stats()
        limits = EngineLimits(
            max_batch=stats.max_batch,
            kv_capacity_tokens=stats.kv_capacity_tokens,
            prefill_budget_tokens=self.config.prefill_budget_tokens,
            max_fetch=self.config.max_fetch,
        )
        held = self.runner.held()
        est_kv = self.runner.estimates.kv_tokens.value
        if stats.kv_measured:  # admission by the engine's own KV use (measured_capacity.py)
            held = measured_held(held, stats.kv_used_tokens, self.runner.pending_decode_context())
            est_kv = self.runner.estimates.prompt_tokens.value
            now = time.monotonic()  # wall: preemptions happen in the engine's real time
            decodes_here = kind == "decode" or self.agent.role == "mixed"
            if decodes_here and held.decode_jobs and not self.preemption_gate.open(stats.preemptions, now):
                return 0
        return pull_size(
            self.agent.role,
            kind,
            limits,
            held,
            self.runner.estimates.prompt_tokens.value,
            est_kv,
        )

    async def _fetch(self, kind: WorkKind, own: bool, n: int, timeout_s: float) -> int:
        psub = self.subs[(kind, own)]
        try:
            msgs = await psub.fetch(n, timeout=timeout_s)
        except (TimeoutError, NatsTimeoutError):
            return 0
        except asyncio.CancelledError:
            raise
        except BUS_ERRORS as exc:  # disconnected, server restarting: back off
            self.fetch_errors += 1
            self.agent.metrics.count_error("fetch")
            self.agent.log.debug("fetch_failed", error=repr(exc))
            await asyncio.sleep(0.25)
            return 0
        expected = GenerateRequest if kind == "prefill" else DecodeHandoff
        for m in msgs:
            work = await self.agent.receive(m, expected)
            if work is None:
                continue  # bad input: answered and term()'d by Service.receive
            if not takes(self.agent.role, kind):  # fetched before an in-place switch (module docstring)
                self.returned += 1
                with contextlib.suppress(*BUS_ERRORS):  # lost, the nak is an ack_wait's redelivery
                    await m.nak()
                continue
            await self.runner.admit(work, m)  # fails only by our bug: the loop's supervisor surfaces it
        return len(msgs)

    async def forward_addressed(self) -> int:
        """Move prompts addressed to this engine to the shared prefill queue (it is becoming a decode engine, which
        does not prefill). Only prefill work is ever addressed, so there is nothing else to move."""
        moved = 0
        while took := await self._forward(0.05):
            moved += took
        return moved

    async def _forward(self, timeout_s: float) -> int:
        """One fetch of this engine's addressed queue, every message moved to the shared prefill queue (stored
        there first, then acked; the message id de-duplicates a repeat after a crash). Returns how many moved."""
        psub = self.subs[("prefill", True)]
        target = self.subject("prefill", False)
        try:
            msgs = await psub.fetch(self.config.max_fetch, timeout=timeout_s)
        except (TimeoutError, NatsTimeoutError):
            return 0
        except BUS_ERRORS as exc:
            self.agent.log.warning("forward_failed", kind="prefill", error=repr(exc))
            await asyncio.sleep(0.25)
            return 0
        moved = 0
        for m in msgs:
            seq = m.metadata.sequence.stream
            try:
                await self.agent.js.publish(target, m.data, headers={"Nats-Msg-Id": f"fwd:{m.subject}:{seq}"})
            except BUS_ERRORS as exc:  # not stored: leave it here, redelivered after a backoff
                delay_s = forward_retry_delay_s(m.metadata.num_delivered)
                self.agent.log.warning("forward_failed", kind="prefill", error=repr(exc), retry_in_s=delay_s)
                with contextlib.suppress(*BUS_ERRORS):
                    await m.nak(delay=delay_s)
                continue
            with contextlib.suppress(*BUS_ERRORS):
                await m.ack()
            moved += 1
        if moved:
            self.agent.log.info("addressed_work_forwarded", requests=moved)
        return moved

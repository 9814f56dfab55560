"""Runs the work an engine pulled: prefill and hand off, decode a handoff, or generate locally; acks it when done.

Rules that keep every request exactly once for the client:
- A message is acked only when its work is done (finished, or its DecodeHandoff stored in JetStream) or handed on
  (migrated / requeued, the new message stored first). A crash leaves it unacked: JetStream redelivers it.
- Redelivery is recognised by the message's stream sequence: a (request_id, sequence) already done is acked without
  work; one still running here just takes the newer delivery for its ack. Another message for a request running
  here (a client retry) is nak'ed with a delay: it runs after this one, and the client keeps the first result.
- Chunks are numbered from the request's `next_chunk_index`. A token is recorded as streamed *before* its chunk is
  published, so a migration resumes exactly after the last chunk the client can have received.
- Policy versions (proto/README.md, "Policy versions"): every chunk names the version that sampled its tokens
  (the backend's stamp; a chunk never spans two). A turn below its `min_policy_version` never runs here: it goes
  back to the queue while that version is loading, or fails when no such version exists. A decode handoff is
  continued only by an engine on the weights that prefilled it: one on newer weights recomputes it (requeued for
  prefill with `min_policy_version` raised to its version; the KV and the unstreamed first token are dropped), one
  on older weights gives it back (it is loading the newer ones). A prefill during which the weights changed is not
  handed off but requeued. A turn holding tokens older than an `AbortOlderThan` bound is aborted, now or when
  pulled later.
- Handing on: a job that streamed nothing is requeued unchanged (a handoff to the decode queue, a request to the
  prefill queue); one that streamed tokens migrates as a GenerateRequest on `work.prefill.any` with
  `resume_token_ids` = everything streamed so far and `next_chunk_index` = the next index.

Times are read from the agent's clock (`io.clock`, scaled seconds): stream times, TTFT/e2e, handoff stamps. The
sleeps here (chunk, heartbeat and progress intervals) are wall-time I/O cadences.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Protocol

import msgspec
from nats.errors import Error as NatsError

from proto import (
    DecodeHandoff,
    GenerateRequest,
    Message,
    PrefillDone,
    ProgressItem,
    RequestFailed,
    RequestFinished,
    Subjects,
    TokenProgress,
)
from proto.context_log import ContextLogError
from services.engine_agent import outputs
from services.engine_agent.backend import (
    Backend,
    BackendError,
    EngineDead,
    GenChunk,
    KvUnavailable,
    RequestAborted,
)
from services.engine_agent.contexts import ContextResolver
from services.engine_agent.job_core import Ack, Adopt, Fail, JobCore, Nak, Start
from services.engine_agent.jobs import Job, request_problem, valid_reply_subject
from services.engine_agent.pull_capacity import HeldWork, PullEstimates, kv_reservation_tokens
from services.engine_agent.switch_rule import OutputEstimate
from services.engine_agent.weights import later_delay_s
from services.engine_agent.weights_core import holds_older
from services.runtime.bus import BUS_ERRORS, MessageTooLarge
from services.runtime.clock import Clock

MAX_ABORTED_IDS = (
    65536  # aborted request ids remembered (a copy still queued after that many aborts would run)
)
DEFAULT_S_PER_TOKEN = 0.05  # inter-token time (scaled seconds) assumed before any has been observed


class AgentIO(Protocol):
    """What the runner needs from the agent (the Service): identity, backend, publishing."""

    engine_id: str
    subjects: Subjects
    backend: Backend
    contexts: ContextResolver
    clock: Clock
    log: Any
    metrics: Any
    weights: Any  # weights.WeightsControl: admission by policy version, the abort bound

    @property
    def policy_version(self) -> int: ...

    @property
    def role(self) -> str: ...

    async def publish(self, subject: str, msg: Message, reply: str = "") -> None: ...

    async def js_publish(self, subject: str, msg: Message, msg_id: str | None = None) -> None: ...

    async def emit(self, cls: type[Message], **fields: Any) -> None: ...

    async def reject(
        self, msg: Any, kind: str, error: str, field: str = "", request_id: str = ""
    ) -> None: ...

    def spawn(self, coro: Any, name: str | None = None) -> asyncio.Task[Any]: ...

    def note_bug(
        self, kind: str, exc: BaseException, /, where: str = "", event: str = "", **fields: Any
    ) -> None: ...

    def clear_bug(self, kind: str, where: str = "") -> None: ...

    def engine_dead(self, exc: BaseException) -> None: ...


class JobRunner:
    def __init__(self, io: AgentIO, chunk_interval_s: float = 0.02) -> None:
        self.io = io
        self.chunk_interval_s = chunk_interval_s
        self.jobs: dict[str, Job] = {}
        self.core = JobCore()  # de-duplication and the decisions (job_core.py); this class executes them
        self.estimates = PullEstimates()  # sizes of work not seen yet, for pulling
        # Answer lengths this engine has seen, for a restart's drain (switch_rule.py): what it knows, where the
        # backend's `expected_output_tokens` is an upper bound (vLLM) or the workload's truth (sim backend).
        self.output_estimate = OutputEstimate()
        self.freed = (
            asyncio.Event()
        )  # set when held work shrinks (a job ends or leaves its prefill): pull more
        # Cumulative counters, read by the stats loop.
        self.prefill_new_tokens = 0
        self.prefill_cached_tokens = 0
        self.decode_tokens = 0
        self.duplicates = 0
        self.kv_lost = 0
        self.aborts = 0
        self.version_waits = 0  # turns given back: the version they need is still loading here
        self.version_recomputes = (
            0  # handoffs recomputed (other weights), prefills requeued (weights changed)
        )
        # Requests a client aborted (AbortRequest), newest last: one pulled later is answered "abort", not run.
        self.aborted_ids: OrderedDict[str, None] = OrderedDict()

    # -- admission -----------------------------------------------------------------------------------------------

    async def admit(self, work: GenerateRequest | DecodeHandoff, msg: Any) -> None:
        """Take one pulled message: de-duplicate, check, and start its job."""
        request = work.request if isinstance(work, DecodeHandoff) else work
        seq = _stream_seq(msg)
        running = self.jobs.get(request.request_id)
        problem = ""
        if running is None:
            problem = request_problem(request, self.io.backend.max_model_len)
            problem = problem or self.io.backend.sampling_problem(request.sampling)
        decision = self.core.admit(
            request.request_id, seq, running.stream_seq if running is not None else None, problem
        )
        match decision:
            case Ack():
                self.duplicates += 1
                await _quietly(msg.ack())
            case Adopt():
                assert running is not None
                running.msg = msg
            case Nak(delay_s=delay_s):
                await _quietly(msg.nak(delay=delay_s))
            case Fail(kind=kind, error=error):
                await self._failed(request, msg, error, request.next_chunk_index, kind=kind)
            case Start():
                aborted = request.request_id in self.aborted_ids or (
                    bool(request.resume_token_ids)
                    and holds_older(request.resume_min_version, self.io.weights.state.abort_below)
                )
                if not aborted and not await self._version_gate(work, msg):
                    return
                job = self._new_job(work, request, msg, seq)
                if aborted:  # aborted while it waited in the queue: answered, never run
                    job.stop = job.aborted = True
                self.jobs[request.request_id] = job
                job.task = self.io.spawn(self._run(job), name=f"job-{request.request_id}")

    async def _version_gate(self, work: GenerateRequest | DecodeHandoff, msg: Any) -> bool:
        """Whether the turn may run on this engine's weights now; if not, it was given back or failed."""
        request = work.request if isinstance(work, DecodeHandoff) else work
        decision = await self.io.weights.admit(request)
        newer = isinstance(work, DecodeHandoff) and work.policy_version > self.io.backend.policy_version
        if decision == "run" and newer:
            decision = "later"  # prefilled under newer weights than ours: we are loading them
        if decision == "run":
            return True
        if decision == "later":
            self.version_waits += 1
            await _quietly(msg.nak(delay=later_delay_s(_num_delivered(msg))))
            return False
        error = self.io.weights.unavailable_error(request)
        self.io.log.warning("version_unavailable", request_id=request.request_id, error=error)
        await self._failed(request, msg, error, request.next_chunk_index, kind="version_unavailable")
        return False

    def _new_job(
        self, work: GenerateRequest | DecodeHandoff, request: GenerateRequest, msg: Any, seq: int
    ) -> Job:
        if isinstance(work, DecodeHandoff):
            kind = "decode"
        else:
            kind = "prefill" if self.io.role == "prefill" else "generate"
        expected = self.io.backend.expected_output_tokens(request)
        context = request.prompt_len + len(request.resume_token_ids)
        self.estimates.observe(context, expected)
        return Job(
            kind=kind,  # type: ignore[arg-type]
            request=request,
            msg=msg,
            stream_seq=seq,
            expected_tokens=expected,
            pulled_wall_s=self.io.clock.now_s(),
            pulled_mono=self.io.clock.monotonic_s(),
            handoff=work if isinstance(work, DecodeHandoff) else None,
            kv_reserved_tokens=0 if kind == "prefill" else kv_reservation_tokens(context, expected),
            next_index=request.next_chunk_index,
            prefill_engine=work.prefill_engine if isinstance(work, DecodeHandoff) else self.io.engine_id,
        )

    def held(self) -> HeldWork:
        """The load of held jobs, for capacity-driven pulling."""
        prefill_jobs = prefill_tokens = decode_jobs = kv = 0
        for job in self.jobs.values():
            if not job.prefilled:  # a prompt still to prefill here
                prefill_jobs += 1
                prefill_tokens += job.context_tokens
            if job.kind != "prefill":
                decode_jobs += 1
                kv += job.kv_reserved_tokens
        return HeldWork(prefill_jobs, prefill_tokens, decode_jobs, kv)

    def pending_decode_context(self) -> int:
        """Context tokens of held decodes the engine has not started yet (no output token of theirs so far)."""
        return sum(
            j.context_tokens for j in self.jobs.values() if j.kind != "prefill" and j.output_tokens == 0
        )

    def in_flight_tokens(self) -> int:
        """Tokens still to compute for held work: prompts not prefilled yet plus output not generated yet."""
        total = 0
        for job in self.jobs.values():
            if not job.prefilled:  # a prompt still to prefill here
                total += job.context_tokens
            if job.kind != "prefill":
                total += job.remaining_tokens
        return total

    def s_per_token(self, job: Job) -> float:
        """The job's observed inter-token time, else the mean over running jobs, else a default."""
        own = job.s_per_token()
        if own is not None:
            return own
        seen = [s for j in self.jobs.values() if (s := j.s_per_token()) is not None]
        return sum(seen) / len(seen) if seen else DEFAULT_S_PER_TOKEN

    async def abort_request(self, request_id: str) -> None:
        """A client's AbortRequest: stop the request's job here, if it runs here (its KV is freed by the backend's
        abort), and remember the id so a copy pulled later is answered without running."""
        self.aborted_ids[request_id] = None
        while len(self.aborted_ids) > MAX_ABORTED_IDS:
            self.aborted_ids.popitem(last=False)
        job = self.jobs.get(request_id)
        if job is None or job.aborted:
            return
        job.aborted = True
        if not job.stop:
            job.stop = True
            await self.io.backend.abort(request_id)

    async def abort_older_than(self, bound: int, served: int) -> list[str]:
        """Abort every held turn holding a token older than `bound`, or running on weights older than it (`served`
        below it): each ends as an aborted one, with its partial output. Returns their request ids."""
        out = []
        for job in list(self.jobs.values()):
            if job.aborted or not (holds_older(job.min_version, bound) or served < bound):
                continue
            out.append(job.request_id)
            await self.abort_request(job.request_id)
        return out

    async def _stopped(self, job: Job) -> None:
        """A stopped job's end: an aborted one answers "abort" with what it streamed and is acked (never
        redelivered); any other is handed on."""
        if not job.aborted:
            await self._hand_on(job)
            return
        self.aborts += 1
        await self._send(job, [], None, final=True, reason="abort")
        await self._finished(job, "abort")

    async def stop_job(self, job: Job) -> None:
        """Ask a job to stop and hand its work on (it acks the message once the new one is stored)."""
        job.stop = True
        await self.io.backend.abort(job.request_id)

    async def hand_on_abandoned(self, job: Job) -> None:
        """A job on a dead engine whose stream has not ended (the engine will never end it): stop waiting for it and
        hand its work on from what it streamed so far. A job that already ended is left as it is."""
        task = job.task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if not job.outcome:
            await self._hand_on(job)

    # -- running -------------------------------------------------------------------------------------------------

    async def _run(self, job: Job) -> None:
        try:
            if job.stop:  # stopped before it started: hand it on untouched (or answer an abort)
                await self._stopped(job)
            elif not await self._resolve(job):
                pass  # its prompt cannot be rebuilt: failed for good, the client told why
            elif job.remaining_tokens == 0 and job.kind != "decode":
                await self._send(job, [], None, final=True, reason="length")
                await self._finished(job, "length")
            elif job.kind == "prefill":
                await self._run_prefill(job)
            elif job.kind == "decode":
                await self._run_decode(job)
            else:
                await self._stream(job, self.io.backend.generate(job.backend_request))
        except asyncio.CancelledError:
            raise  # the agent is going away: the unacked message is redelivered
        except EngineDead as exc:
            # Not the request's fault and no retry here: hand it on at once (exactly after what was streamed) and
            # let the agent leave (`EngineAgent.engine_dead`).
            self.io.engine_dead(exc)
            await self._hand_on(job)
        except MessageTooLarge as exc:  # its handoff or migration can never be published: no retry helps
            self.io.log.warning("work_too_large", request_id=job.request_id, kind=job.kind, error=str(exc))
            await self._failed(job.request, job.msg, str(exc), job.next_index, kind="payload_too_large")
            job.outcome = "failed"
        except (BackendError, *BUS_ERRORS) as exc:  # the engine failed the request, or the bus did
            self.io.metrics.count_error("engine")
            self.io.log.error("job_failed", request_id=job.request_id, kind=job.kind, error=repr(exc))
            await self._retry_or_fail(job, exc)
        except Exception as exc:
            # Broad on purpose: our bug in one job must still end in a redelivery or an error reply to its
            # client, never in a request lost silently. Surfaced (logged, counted, in health).
            self.io.note_bug("job", exc, event="job_crashed", request_id=job.request_id, kind=job.kind)
            await self._retry_or_fail(job, exc)
        else:
            self.io.clear_bug("job")
        finally:
            job.phase = "done"
            if self.jobs.get(job.request_id) is job:
                del self.jobs[job.request_id]
            self.freed.set()

    async def _resolve(self, job: Job) -> bool:
        """Rebuild the job's whole prompt from a lean request (`contexts.py`); False: it never can, and the job was
        failed with the reason. Bus errors propagate to `_run`, which redelivers the work."""
        try:
            job.resolved = await self.io.contexts.resolve(job.request)
        except ContextLogError as exc:
            self.io.log.warning("context_unresolvable", request_id=job.request_id, error=str(exc))
            await self._failed(job.request, job.msg, str(exc), job.next_index, kind="unresolvable_context")
            job.outcome = "failed"
            return False
        return True

    async def _run_prefill(self, job: Job) -> None:
        req = job.request
        job.phase = "prefill"
        before = self.io.backend.policy_version
        try:
            res = await self.io.backend.prefill(job.backend_request)
        except RequestAborted:
            if not job.stop:
                raise
            await self._stopped(job)
            return
        self._count_prefill(res.new_tokens, res.cached_tokens)
        job.cached_tokens = res.cached_tokens
        version = res.policy_version if res.policy_version is not None else self.io.backend.policy_version
        if version != before:  # the weights changed during the prefill: its KV mixes two policies
            self.version_recomputes += 1
            self.io.log.info(
                "prefill_straddled_update", request_id=job.request_id, versions=[before, version]
            )
            await self._hand_on(job, to_prefill=True)
            return
        if res.finished:  # the first token ends the turn: answer it here, nothing to hand off
            lps = [res.first_logprob] if res.first_logprob is not None else None
            top = [res.first_top_logprobs] if res.first_top_logprobs is not None else None
            await self._prefill_done(job, res.new_tokens, res.cached_tokens, res.prefill_s, handed_off=False)
            reason = res.finish_reason or "length"
            await self._send(
                job, [res.first_token_id], lps, final=True, reason=reason, top=top, version=version
            )
            await self._finished(job, res.finish_reason or "length")
            return
        handoff = outputs.decode_handoff(job, res, self.io.engine_id, self.io.clock.now_s(), version)
        msg_id = f"{req.request_id}#{req.attempt}:h{job.stream_seq}"
        await self.io.js_publish(self.io.subjects.decode_work_any, handoff, msg_id=msg_id)
        await self._prefill_done(job, res.new_tokens, res.cached_tokens, res.prefill_s, handed_off=True)
        await self._complete(job, "handed_off")

    async def _run_decode(self, job: Job) -> None:
        h = job.handoff
        assert h is not None
        version = self.io.backend.policy_version
        if h.policy_version != version:  # older weights (newer ones were given back at admission)
            # Never continue from KV of other weights (proto/README.md, "Policy versions"): prefill it again under
            # weights at least as new as ours; the unstreamed first token and the KV are dropped.
            self.version_recomputes += 1
            self.io.log.info(
                "handoff_recomputed",
                request_id=job.request_id,
                handoff_version=h.policy_version,
                version=version,
            )
            req = job.request
            again = msgspec.structs.replace(req, min_policy_version=max(req.min_policy_version, version))
            msg_id = f"{req.request_id}#{req.attempt}:v{version}:{job.stream_seq}"
            await self.io.js_publish(self.io.subjects.prefill_work_any, again, msg_id=msg_id)
            await self._complete(job, "requeued")
            return
        job.cached_tokens = h.prefill_cached_tokens
        if h.first_token_id is None:  # nothing sampled, nothing to resume from: prefill it again
            self.kv_lost += 1
            await self._hand_on(job, to_prefill=True)
            return
        lps = [h.first_logprob] if h.first_logprob is not None else None
        top = [h.first_top_logprobs] if h.first_top_logprobs is not None else None
        job.phase = "decode"
        self.freed.set()
        final = job.output_tokens + 1 >= job.expected_tokens
        await self._send(
            job,
            [h.first_token_id],
            lps,
            final=final,
            reason="length" if final else "",
            top=top,
            version=h.policy_version,
        )
        if final:
            await self._finished(job, "length")
            return
        await self._stream(
            job, self.io.backend.decode(msgspec.structs.replace(h, request=job.backend_request))
        )

    async def _stream(self, job: Job, stream: AsyncIterator[GenChunk]) -> None:
        """Relay a backend stream to the client until it finishes, or until the job is asked to stop."""
        if job.kind == "generate":
            job.phase = "prefill"
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            while not job.stop:
                try:
                    chunk = await anext(stream)
                except StopAsyncIteration:
                    if job.stop:
                        break
                    raise BackendError("backend stream ended without a final chunk") from None
                except KvUnavailable as exc:
                    self.kv_lost += 1
                    self.io.log.warning("kv_unavailable", request_id=job.request_id, error=str(exc))
                    await self._hand_on(job, to_prefill=True)
                    return
                if chunk.prefill is not None:
                    info = chunk.prefill
                    self._count_prefill(info.new_tokens, info.cached_tokens)
                    job.cached_tokens = info.cached_tokens
                    job.phase = "decode"
                    self.freed.set()
                    await self._prefill_done(job, info.new_tokens, info.cached_tokens, info.prefill_s, False)
                self.decode_tokens += len(chunk.token_ids)
                if chunk.finished and chunk.finish_reason != "abort":
                    await self._send(
                        job,
                        chunk.token_ids,
                        chunk.logprobs,
                        final=True,
                        reason=chunk.finish_reason,
                        top=chunk.top_logprobs,
                        version=chunk.policy_version,
                    )
                    await self._finished(job, chunk.finish_reason)
                    return
                if job.stop:
                    break  # these tokens never reach the client: the next engine generates them again
                if chunk.token_ids:
                    await self._send(
                        job,
                        chunk.token_ids,
                        chunk.logprobs,
                        top=chunk.top_logprobs,
                        version=chunk.policy_version,
                    )
                # Let tokens accumulate in the backend: one chunk per request per interval (wall), not per token.
                await self.io.backend.wait_output(job.request_id, self.chunk_interval_s)
        await self.io.backend.abort(job.request_id)
        await self._stopped(job)

    # -- output --------------------------------------------------------------------------------------------------

    async def _send(
        self,
        job: Job,
        ids: list[int],
        logprobs: list[float] | None,
        final: bool = False,
        reason: str = "",
        top: list[list[tuple[int, float]]] | None = None,
        version: int | None = None,
    ) -> None:
        """Publish the job's next chunk; `version`: the weights that sampled `ids` (None: the engine's now)."""
        now = self.io.clock.monotonic_s()
        version = self.io.backend.policy_version if version is None else version
        if ids:
            if job.first_stream_mono is None:
                job.first_stream_mono = now
            job.last_stream_mono = now
            job.sampled(version)
        job.streamed_ids.extend(ids)  # before publishing: see the module docstring
        index = job.next_index
        job.next_index += 1
        chunk = outputs.token_chunk(
            job,
            index,
            ids,
            logprobs,
            engine_id=self.io.engine_id,
            final=final,
            reason=reason,
            policy_version=version,
            now_s=self.io.clock.now_s(),
            now_mono=now,
            top_logprobs=top,
        )
        await self.io.publish(job.request.reply_to, chunk)

    async def _prefill_done(
        self, job: Job, new: int, cached: int, prefill_s: float, handed_off: bool
    ) -> None:
        req = job.request
        await self.io.emit(
            PrefillDone,
            request_id=req.request_id,
            traj_id=req.traj_id,
            turn=req.turn,
            new_tokens=new,
            cached_tokens=cached,
            prefill_s=max(0.0, prefill_s),
            handed_off=handed_off,
            away=req.affinity_engine not in ("", self.io.engine_id),
        )

    async def _finished(self, job: Job, reason: str) -> None:
        if reason != "abort":  # a whole answer, resumed tokens included
            self.output_estimate.observe(job.output_tokens)
        fields = outputs.finished_fields(
            job, reason, self.io.policy_version, self.io.clock.now_s(), self.io.clock.monotonic_s()
        )
        await self.io.emit(RequestFinished, **fields)
        await self._complete(job, "finished")

    async def _complete(self, job: Job, outcome: str) -> None:
        job.outcome = outcome  # type: ignore[assignment]
        self.core.completed(job.request_id, job.stream_seq)
        await _quietly(job.msg.ack())

    # -- handing on and failing ----------------------------------------------------------------------------------

    async def _hand_on(self, job: Job, to_prefill: bool = False) -> None:
        """Put the work back on a queue (see the module docstring), then ack the original message."""
        if self.jobs.get(job.request_id) is job:
            del self.jobs[job.request_id]  # so this engine may take the handed-on copy at once
        publish = self.core.hand_on(job, self.io.subjects, to_prefill)
        await self.io.js_publish(publish.subject, publish.message, msg_id=publish.msg_id)
        self.io.log.info(
            "work_handed_on",
            request_id=job.request_id,
            outcome=publish.outcome,
            streamed=len(job.streamed_ids),
        )
        await self._complete(job, publish.outcome)

    async def _retry_or_fail(self, job: Job, exc: Exception) -> None:
        """The engine (or this code) failed a request: redeliver it a few times, then fail it for good."""
        match self.core.engine_error(_num_delivered(job.msg), repr(exc)):
            case Nak(delay_s=delay_s):
                job.outcome = "retried"
                await _quietly(job.msg.nak(delay=delay_s))
            case Fail(kind=kind, error=error):
                await self._failed(job.request, job.msg, error, job.next_index, kind=kind)
                job.outcome = "failed"

    async def _failed(self, request: GenerateRequest, msg: Any, error: str, index: int, kind: str) -> None:
        """RequestFailed event, a final error chunk to the client, ErrorReply on the errors subject, term()."""
        await self.io.emit(
            RequestFailed,
            request_id=request.request_id,
            traj_id=request.traj_id,
            turn=request.turn,
            error=error,
            retriable=False,
        )
        if valid_reply_subject(request.reply_to):
            with contextlib.suppress(*BUS_ERRORS):
                await self.io.publish(
                    request.reply_to, outputs.error_chunk(request, index, error, self.io.engine_id)
                )
        await self.io.reject(msg, kind, error, request_id=request.request_id)

    # -- periodic ------------------------------------------------------------------------------------------------

    async def heartbeat_loop(self, interval_s: float) -> None:
        """Tell JetStream that held work is still in progress, so its ack_wait (wall seconds) does not expire."""
        while True:
            await asyncio.sleep(interval_s)
            for job in list(self.jobs.values()):
                await _quietly(job.msg.in_progress())

    async def progress_loop(self, interval_s: float) -> None:
        """One TokenProgress per interval (wall) listing every decoding request that made progress (never per
        token)."""
        while True:
            await asyncio.sleep(interval_s)
            items = []
            for job in list(self.jobs.values()):
                if job.phase == "decode" and job.output_tokens != job.reported_tokens:
                    job.reported_tokens = job.output_tokens
                    req = job.request
                    items.append(
                        ProgressItem(
                            request_id=req.request_id,
                            traj_id=req.traj_id,
                            turn=req.turn,
                            output_tokens=job.output_tokens,
                        )
                    )
            if items:
                await self.io.emit(TokenProgress, items=items)

    def _count_prefill(self, new: int, cached: int) -> None:
        self.prefill_new_tokens += new
        self.prefill_cached_tokens += cached


def _stream_seq(msg: Any) -> int:
    try:
        return int(msg.metadata.sequence.stream)
    except (NatsError, AttributeError):
        return -1  # not a JetStream message (tests feeding core messages): no redelivery to recognise


def _num_delivered(msg: Any) -> int:
    try:
        return int(msg.metadata.num_delivered)
    except (NatsError, AttributeError):
        return 1


async def _quietly(aw: Any) -> None:
    """Ack/nak/in_progress: best effort. Lost, they only cause a redelivery, which de-duplication absorbs."""
    with contextlib.suppress(*BUS_ERRORS):
        await aw

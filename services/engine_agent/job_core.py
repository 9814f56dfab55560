"""The engine agent's job decisions, pure: what to do with a pulled message, where to hand work on, when an engine
error retries. `JobRunner` (runner.py) executes the effects these return; nothing here awaits, reads a clock or
touches NATS, so every rule of exactly-once delivery (runner.py's module docstring) is stated and tested here once.

Effects are frozen values:
* `Ack`     — acknowledge the message (its work is done, or it was done before: a redelivery);
* `Nak`     — give it back for redelivery after `delay_s` (a client retry of a request running here; an engine
               error with deliveries left);
* `Adopt`   — a redelivery of the message a running job holds: the job acks the newest delivery when it ends;
* `Fail`    — answer it as failed for good (bad request, or an engine error with no delivery left);
* `Start`   — run it as a new job;
* `Publish` — store a message on the work stream (with its de-duplication id) before the original is acked.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from proto import DecodeHandoff, GenerateRequest, Subjects
from services.engine_agent import outputs
from services.engine_agent.jobs import Job

MAX_DONE_KEYS = 100_000  # (request_id, stream sequence) pairs remembered for de-duplication
MAX_DELIVERIES_ON_ERROR = 3  # an engine error naks the work for redelivery this many times, then fails it
RETRY_DELAY_S = 1.0  # a nak's redelivery delay: long enough for the running copy to finish first


@dataclass(frozen=True, slots=True)
class Ack:
    pass


@dataclass(frozen=True, slots=True)
class Nak:
    delay_s: float = RETRY_DELAY_S


@dataclass(frozen=True, slots=True)
class Adopt:
    pass


@dataclass(frozen=True, slots=True)
class Fail:
    kind: str  # ErrorReply kind: "invalid_request" | "engine"
    error: str


@dataclass(frozen=True, slots=True)
class Start:
    pass


@dataclass(frozen=True, slots=True)
class Publish:
    subject: str
    message: GenerateRequest | DecodeHandoff
    msg_id: str
    outcome: str  # the job's outcome once stored: "migrated" | "requeued"


Admission = Ack | Adopt | Nak | Fail | Start


class JobCore:
    """The de-duplication memory and the decisions over it."""

    def __init__(self, max_done: int = MAX_DONE_KEYS) -> None:
        self.max_done = max_done
        self._done: OrderedDict[tuple[str, int], None] = OrderedDict()

    def admit(self, request_id: str, seq: int, running_seq: int | None, problem: str) -> Admission:
        """A pulled message for `request_id` at stream sequence `seq`. `running_seq`: the sequence of the job
        running here for that request (None: none runs); `problem`: what is wrong with the request ("" if
        nothing)."""
        if (request_id, seq) in self._done:
            return Ack()  # done before: the ack was lost, the work is not
        if running_seq is not None:
            # The same message redelivered while it runs (an ack_wait ran out): the job acks the newest. Another
            # message for the same request (a client retry): after this one, whose result the client keeps.
            return Adopt() if running_seq == seq else Nak()
        if problem:
            return Fail("invalid_request", problem)
        return Start()

    def completed(self, request_id: str, seq: int) -> Ack:
        """The job of that message is done (finished, handed off or handed on): remember it, then ack."""
        self._done[(request_id, seq)] = None
        while len(self._done) > self.max_done:
            self._done.popitem(last=False)
        return Ack()

    def done(self, request_id: str, seq: int) -> bool:
        return (request_id, seq) in self._done

    @staticmethod
    def hand_on(job: Job, subjects: Subjects, to_prefill: bool = False) -> Publish:
        """Where a stopped job's work goes: one that streamed tokens migrates as a request resuming after them —
        to the engine `job.hand_on_to` names (it holds the prefix) or the shared prefill queue; one that streamed
        nothing is requeued unchanged — a handoff to the decode queue, unless its KV is gone (`to_prefill`), else
        the request to the prefill queue."""
        if job.streamed_ids:
            moved = outputs.migrated_request(job)
            subject = (
                subjects.prefill_work_for(job.hand_on_to) if job.hand_on_to else subjects.prefill_work_any
            )
            return Publish(subject, moved, outputs.hand_on_msg_id(job, moved), "migrated")
        msg_id = outputs.hand_on_msg_id(job, None)
        if job.handoff is not None and not to_prefill:
            return Publish(subjects.decode_work_any, job.handoff, msg_id, "requeued")
        return Publish(subjects.prefill_work_any, job.request, msg_id, "requeued")

    @staticmethod
    def engine_error(deliveries: int, error: str) -> Nak | Fail:
        """The engine failed a request on its `deliveries`-th delivery: redeliver it (another engine, or this
        one recovered, may serve it) until `MAX_DELIVERIES_ON_ERROR`, then fail it for good."""
        if deliveries < MAX_DELIVERIES_ON_ERROR:
            return Nak()
        return Fail("engine", f"engine error: {error}")

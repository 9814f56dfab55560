"""The I/O of the context log (`proto/context_log.py`): write a turn's segment, read a trajectory's, purge it.

Writing is the client's (before it publishes the turn, so no engine can see a reference the log does not hold);
reading is an engine's, when it lacks the prefix a turn refers to; purging is the client's, when the trajectory
finishes. Reads are JetStream direct gets (`next_by_subj`): no consumer to create or delete, any replica may answer.
On nats-server 2.11 or later one batched direct get returns every message of the trajectory in one request (the
server streams them, then an end-of-batch status); an older server is asked once per message (its turns, plus
the parts of very long segments), which costs a round trip each.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from proto import Subjects
from proto.context_log import ContextLogError, Segment, SegmentReader, parts
from services.runtime.bus import js_publish_patiently

# A read of more messages than this is not a trajectory's log but a runaway (a client writing in a loop).
MAX_LOG_MESSAGES = 100_000
BATCH = 1024  # messages a batched direct get asks for at once
BATCH_GET_SINCE = (2, 11)  # nats-server versions that answer `batch` in a direct get
REPLY_TIMEOUT_S = 5.0  # wall seconds for the server's next message of a batch


@dataclass(frozen=True, slots=True)
class LogRead:
    segments: dict[int, Segment]  # complete segments by turn
    last_seq: int  # the stream sequence of the last message read (where a later read may start after)


async def write_segment(
    js: JetStreamContext,
    subjects: Subjects,
    traj_id: str,
    turn: int,
    prefix_turn: int,
    prefix_len: int,
    ids: array,
    max_payload: int,
    writer: str,
    wait_s: float,
) -> int:
    """Store turn `turn`'s segment (JetStream-acked, retried while the server restarts for up to `wait_s` wall
    seconds); returns the bytes written. `writer` makes the message ids unique to this write, so a retried publish
    is stored once but a new run reusing the trajectory id is not dropped as a duplicate."""
    subject = subjects.context(traj_id, turn)
    written = 0
    for i, part in enumerate(parts(prefix_turn, prefix_len, ids, max_payload)):
        headers = {**part.headers, "Nats-Msg-Id": f"ctx:{writer}:{traj_id}:{turn}:{i}"}
        await js_publish_patiently(js, subject, part.body, headers, wait_s)
        written += len(part.body)
    return written


async def read_segments(nc: NATS, subjects: Subjects, traj_id: str, after_seq: int = 0) -> LogRead:
    """Every complete segment of `traj_id` in the log after stream sequence `after_seq` (0: all), by turn, and the
    last sequence read. Raises ContextLogError for a message that is not a segment part; bus errors
    (nats.errors.Error, TimeoutError) pass through: the read may be retried."""
    reader = SegmentReader(traj_id)
    last_seq = after_seq
    prefix = subjects.context_of(traj_id)[:-1]  # "ns.ctx.<traj>."
    read = _read_batched if _batch_get(nc) else _read_one_by_one
    count = 0
    async for subject, headers, body in read(
        nc, subjects.context_stream, subjects.context_of(traj_id), after_seq + 1
    ):
        count += 1
        last_seq = max(last_seq, int(headers.get("Nats-Sequence", "0") or 0))
        if count > MAX_LOG_MESSAGES:
            raise ContextLogError(traj_id, 0, f"more than {MAX_LOG_MESSAGES} messages in its log")
        turn_s = subject[len(prefix) :]
        if not turn_s.isdigit():
            raise ContextLogError(traj_id, 0, f"a message on {subject!r} is not on a turn's subject")
        reader.add(int(turn_s), headers, body)
    return LogRead(reader.segments, last_seq)


def _batch_get(nc: NATS) -> bool:
    version = str((getattr(nc, "_server_info", None) or {}).get("version", "0"))
    parts = [int(p) if p.isdigit() else 0 for p in version.split("-")[0].split(".")[:2]]
    return tuple(parts) >= BATCH_GET_SINCE


async def _read_batched(nc: NATS, stream: str, subject: str, seq: int) -> Any:
    """(subject, headers, body) of every message on `subject` in `stream` from sequence `seq`, through batched
    direct gets."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        while True:
            request = json.dumps({"seq": seq, "next_by_subj": subject, "batch": BATCH}).encode()
            await nc.publish(f"$JS.API.DIRECT.GET.{stream}", request, reply=inbox)
            pending = 0
            while True:
                try:
                    msg = await sub.next_msg(timeout=REPLY_TIMEOUT_S)
                except NatsTimeoutError:
                    raise TimeoutError(
                        f"direct get on {stream}: no answer within {REPLY_TIMEOUT_S} s"
                    ) from None
                headers: Mapping[str, str] = msg.headers or {}
                status = headers.get("Status")
                if status == "404":  # nothing (more) on the subject
                    return
                if status == "204":  # end of this batch: what is left says whether to ask again
                    pending = int(headers.get("Nats-Num-Pending", "0") or 0)
                    break
                if status:
                    raise APIError(
                        code=int(status), description=str(headers.get("Description", "")), stream=stream
                    )
                seq = int(headers.get("Nats-Sequence", "0")) + 1
                yield headers.get("Nats-Subject", ""), headers, msg.data
            if pending <= 0:
                return
    finally:
        await sub.unsubscribe()


async def _read_one_by_one(nc: NATS, stream: str, subject: str, seq: int) -> Any:
    """The same as `_read_batched`, one direct get per message (nats-server before 2.11)."""
    js: JetStreamContext = nc.jetstream()
    while True:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, direct=True, next=True)
        except NotFoundError:
            return
        yield msg.subject or "", {**(msg.headers or {}), "Nats-Sequence": str(msg.seq or 0)}, msg.data or b""
        seq = int(msg.seq or 0) + 1


async def holds(js: JetStreamContext, subjects: Subjects, traj_id: str) -> bool:
    """Whether the log holds any segment of `traj_id`: a trajectory some client sent a turn of and has not finished
    (finishing purges it; the stream's max age ends one whose client died). One direct get of the first message;
    bus errors (nats.errors.Error, TimeoutError) pass through."""
    try:
        await js.get_msg(
            subjects.context_stream, seq=1, subject=subjects.context_of(traj_id), direct=True, next=True
        )
    except NotFoundError:
        return False
    return True


async def purge(js: JetStreamContext, subjects: Subjects, traj_id: str) -> None:
    """Remove every segment of `traj_id` (the trajectory finished: no turn will refer to them)."""
    await js.purge_stream(subjects.context_stream, subject=subjects.context_of(traj_id))

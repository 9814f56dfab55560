"""The I/O of the context log (`proto/context_log.py`): write a turn's segment, read a trajectory's, purge it.

Writing is the client's (before it publishes the turn, so no engine can see a reference the log does not hold);
reading is an engine's, when it lacks the prefix a turn refers to; purging is the client's, when the trajectory
finishes. Reads are JetStream direct gets (`next_by_subj`), one per message: no consumer to create or delete, any
replica may answer, and the number of messages is the trajectory's turns (plus parts of very long segments).
"""

from __future__ import annotations

from array import array

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from proto import Subjects
from proto.context_log import ContextLogError, Segment, SegmentReader, parts
from services.runtime.bus import js_publish_patiently

# A read of more messages than this is not a trajectory's log but a runaway (a client writing in a loop).
MAX_LOG_MESSAGES = 100_000


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


async def read_segments(js: JetStreamContext, subjects: Subjects, traj_id: str) -> dict[int, Segment]:
    """Every complete segment of `traj_id` in the log, by turn. Raises ContextLogError for a message that is not a
    segment part; bus errors (nats.errors.Error, TimeoutError) pass through: the read may be retried."""
    reader = SegmentReader(traj_id)
    stream = subjects.context_stream
    prefix = subjects.context_of(traj_id)[:-1]  # "ns.ctx.<traj>."
    seq = 1
    for _ in range(MAX_LOG_MESSAGES):
        try:
            msg = await js.get_msg(
                stream, seq=seq, subject=subjects.context_of(traj_id), direct=True, next=True
            )
        except NotFoundError:
            return reader.segments
        turn_s = (msg.subject or "")[len(prefix) :]
        if not turn_s.isdigit():
            raise ContextLogError(traj_id, 0, f"a message on {msg.subject!r} is not on a turn's subject")
        reader.add(int(turn_s), msg.headers, msg.data or b"")
        seq = int(msg.seq or 0) + 1
    raise ContextLogError(traj_id, 0, f"more than {MAX_LOG_MESSAGES} messages in its log")


async def purge(js: JetStreamContext, subjects: Subjects, traj_id: str) -> None:
    """Remove every segment of `traj_id` (the trajectory finished: no turn will refer to them)."""
    await js.purge_stream(subjects.context_stream, subject=subjects.context_of(traj_id))

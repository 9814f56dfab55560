"""What a trajectory's next turn puts on the wire: its prefix reference, its segment and the ids inline (pure,
`LeanPrompts`), and the client's writes to the context log (`ContextLogWriter`, the I/O).

The rule (proto/README.md, "The lean wire"): a prompt that starts with the whole prompt of the last turn logged
refers to that turn and logs only the ids after it; any other prompt (the first, or one that rewrote its history)
logs itself whole with no reference. The segment's ids also travel inline in the request up to `inline_max`;
beyond, the engine reads them from the log (so a request stays small whatever the context). The last logged
prompt is kept as a copy: a caller may extend its own list in place for the next turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import nats
from nats.js import JetStreamContext

from proto import Subjects
from proto.context_log import ids_array
from services.runtime.context_log_io import holds, purge, write_segment
from services.runtime.logging import get_logger

log = get_logger("rollout_client", "sdk")


@dataclass(frozen=True, slots=True)
class TurnWire:
    """One turn's wire form. `segment`: the ids logged; `inline`: the ids in the request (`segment` or none)."""

    prefix_turn: int
    prefix_len: int
    segment: list[int]
    inline: list[int]


@dataclass
class LeanPrompts:
    """A trajectory's last logged prompt (a copy) and its turn; `logged`: anything was logged (purge at finish)."""

    last: list[int] | None = field(default=None, repr=False)
    last_turn: int = 0
    logged: bool = False

    def plan(self, ids: list[int], inline_max: int) -> TurnWire:
        """The wire form of a prompt `ids` (no side effect: `logged_as` records it once its segment is stored)."""
        prev = self.last
        extends = prev is not None and 0 < len(prev) <= len(ids) and ids[: len(prev)] == prev
        prefix_turn, prefix_len = (self.last_turn, len(prev)) if extends and prev is not None else (0, 0)
        segment = ids[prefix_len:] if prefix_len else ids
        return TurnWire(prefix_turn, prefix_len, segment, segment if len(segment) <= inline_max else [])

    def logged_as(self, turn: int, ids: list[int]) -> None:
        """Turn `turn`'s prompt `ids` (the caller's copy, not to be mutated) is in the log."""
        self.last, self.last_turn, self.logged = ids, turn, True


class ContextLogWriter:
    """A client's writes to the context log: each turn's segment before the turn, a finished trajectory's purge;
    and whether a trajectory it does not hold has segments there (`holds`)."""

    def __init__(self, js: JetStreamContext, subjects: Subjects, writer: str, wait_s: float) -> None:
        self.js = js
        self.subjects = subjects
        self.writer = writer  # unique to this client: part of the message ids (see `write_segment`)
        self.wait_s = wait_s  # wall seconds a write waits out a server restart
        self.bytes = 0  # written so far

    async def write(self, traj_id: str, turn: int, wire: TurnWire, max_payload: int) -> None:
        """Store turn `turn`'s segment (JetStream-acked). Raises ValueError for a token id outside 0..2^32-1, and the
        bus's errors once `wait_s` has passed."""
        ids = ids_array(wire.segment)
        self.bytes += await write_segment(
            self.js, self.subjects, traj_id, turn, wire.prefix_turn, wire.prefix_len, ids, max_payload,
            self.writer, self.wait_s,
        )  # fmt: skip

    async def holds(self, traj_id: str) -> bool:
        """Whether a trajectory with id `traj_id` has turns logged and is not finished (by any client). Raises the
        bus's errors (nats.errors.Error, TimeoutError)."""
        return await holds(self.js, self.subjects, traj_id)

    async def purge(self, traj_id: str) -> None:
        """Drop a finished trajectory's segments; a failure is only logged (the stream's max age removes them)."""
        try:
            await purge(self.js, self.subjects, traj_id)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("context_purge_failed", traj_id=traj_id, error=repr(exc))

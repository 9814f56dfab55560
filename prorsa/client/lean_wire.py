"""What a trajectory's next turn puts on the wire (pure): its prefix reference, its segment and the ids inline.

The rule (proto/README.md, "The lean wire"): a prompt that starts with the whole prompt of the last turn logged
refers to that turn and logs only the ids after it; any other prompt (the first, or one that rewrote its history)
logs itself whole with no reference. The segment's ids also travel inline in the request up to `inline_max`;
beyond, the engine reads them from the log (so a request stays small whatever the context). The last logged
prompt is kept as a copy: a caller may extend its own list in place for the next turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

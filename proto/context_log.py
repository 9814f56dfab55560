"""The context log: where a trajectory's prompts live on the bus, so a turn sends only its new tokens.

Theory of operation. A turn's prompt is almost always the previous turn's prompt plus that turn's output and the
tool's observation; sending the whole context every turn costs bytes that grow with the square of a trajectory's
length (a 100-turn, 128k-token agent resends ~6 M tokens). So a client writes each turn's *segment* once — which
earlier turn's prompt it extends, how many of that prompt's tokens it keeps, and the ids after them — to the
JetStream stream `<NS>_CONTEXT`, subject `ns.ctx.<traj_id>.<turn>`, before it publishes the turn. The turn's
`GenerateRequest` then carries the same reference (`prefix_turn`, `prefix_len`) and the segment's ids inline (or
none, when there are too many to inline: `context_logged` with empty `prompt_token_ids`). An engine that holds the
referenced prompt (it served the previous turn) extends it in memory; any other engine, or one that restarted,
rebuilds it from the log, which is a file-backed, replicable stream and so survives the loss of any engine. The
client purges `ns.ctx.<traj_id>.>` when the trajectory finishes; the stream's max age removes what a dead client
left.

One segment = one or more messages on `ns.ctx.<traj_id>.<turn>`, in order, each with these headers (decimal text):
  Prorsa-Prefix-Turn  the earlier turn whose prompt this one extends (0 with Prorsa-Prefix-Len 0: no prefix)
  Prorsa-Prefix-Len   how many tokens of that prompt come first
  Prorsa-Tokens       ids in the whole segment (all parts)
  Prorsa-Part         "i/n": this message is part i (0-based) of n
and a body of token ids as unsigned 32-bit little-endian integers (4 bytes each; no other framing). A segment is
split into parts so that no message exceeds the server's max_payload. Reading: every message on
`ns.ctx.<traj_id>.>` in stream order (JetStream direct get, `next_by_subj`); a part 0 starts a new write of its
turn, and the last complete write of a turn wins. The prompt of turn t is then
  prompt(t) = prompt(prefix_turn)[:prefix_len] + ids(t)        (just ids(t) when prefix_len is 0)
followed back to a turn without a prefix.

Everything here is pure (no I/O): the shells that publish and read are `services/runtime/context_log_io.py`.
Errors: `ContextLogError` for anything that cannot be rebuilt — a missing or incomplete segment, a reference past
the end of its prefix, a body that is not whole 32-bit ids — naming the trajectory and turn.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

HEADER_PREFIX_TURN = "Prorsa-Prefix-Turn"
HEADER_PREFIX_LEN = "Prorsa-Prefix-Len"
HEADER_TOKENS = "Prorsa-Tokens"
HEADER_PART = "Prorsa-Part"
MAX_TOKEN_ID = 2**32 - 1
ID_BYTES = 4
# Room left in a part for its headers and NATS's framing, below the server's max_payload.
PART_OVERHEAD_BYTES = 1024
# Parts are at most this many ids (1 MiB) even under a larger max_payload: a smaller message keeps one slow
# segment from holding a connection's write buffer.
MAX_PART_TOKENS = 262_144
_BIG_ENDIAN = sys.byteorder == "big"


class ContextLogError(ValueError):
    """A prompt that cannot be rebuilt from the context log (see the module doc); `traj_id` and `turn` name it."""

    def __init__(self, traj_id: str, turn: int, reason: str) -> None:
        self.traj_id = traj_id
        self.turn = turn
        self.reason = reason
        super().__init__(f"context log: cannot rebuild the prompt of {traj_id} turn {turn}: {reason}")


def ids_array(ids: Iterable[int]) -> array:
    """Token ids as a compact unsigned 32-bit array. Raises ValueError (OverflowError) for an id outside 0..2^32-1."""
    try:
        return array("I", ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in 0..{MAX_TOKEN_ID}: {exc}") from None


def pack(ids: array) -> bytes:
    """Little-endian bytes of a `ids_array`."""
    if not _BIG_ENDIAN:
        return ids.tobytes()
    swapped = array("I", ids)
    swapped.byteswap()
    return swapped.tobytes()


def unpack(data: bytes | bytearray | memoryview, traj_id: str = "", turn: int = 0) -> array:
    """The ids of a body. Raises ContextLogError when it is not a whole number of 32-bit ids."""
    if len(data) % ID_BYTES:
        raise ContextLogError(
            traj_id, turn, f"a body of {len(data)} bytes is not a whole number of 32-bit ids"
        )
    out = array("I")
    out.frombytes(bytes(data))
    if _BIG_ENDIAN:
        out.byteswap()
    return out


def part_tokens(max_payload: int) -> int:
    """Ids per part under a server's `max_payload` (bytes). Raises ValueError for a max_payload too small to carry any."""
    n = min(MAX_PART_TOKENS, (max_payload - PART_OVERHEAD_BYTES) // ID_BYTES)
    if n < 1:
        raise ValueError(f"max_payload {max_payload} leaves no room for a context-log part")
    return n


@dataclass(frozen=True, slots=True)
class Part:
    """One message of a segment: its headers and body."""

    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class Segment:
    """What turn `turn` of a trajectory added: `ids` after the first `prefix_len` tokens of turn `prefix_turn`."""

    turn: int
    prefix_turn: int
    prefix_len: int
    ids: array  # array('I')


def parts(prefix_turn: int, prefix_len: int, ids: array, max_payload: int) -> list[Part]:
    """The messages of one segment (at least one, even for no ids) under a server's `max_payload`."""
    step = part_tokens(max_payload)
    n = max(1, -(-len(ids) // step))
    common = {
        HEADER_PREFIX_TURN: str(prefix_turn),
        HEADER_PREFIX_LEN: str(prefix_len),
        HEADER_TOKENS: str(len(ids)),
    }
    return [Part({**common, HEADER_PART: f"{i}/{n}"}, pack(ids[i * step : (i + 1) * step])) for i in range(n)]


def _int_header(headers: Mapping[str, str], name: str, traj_id: str, turn: int) -> int:
    raw = headers.get(name)
    try:
        value = int(raw) if raw is not None else -1
    except ValueError:
        value = -1
    if value < 0:
        raise ContextLogError(traj_id, turn, f"header {name} is {raw!r}, not a non-negative integer")
    return value


class SegmentReader:
    """Assembles the segments of one trajectory from its messages, fed in stream order (see the module doc)."""

    def __init__(self, traj_id: str) -> None:
        self.traj_id = traj_id
        self.segments: dict[int, Segment] = {}  # complete segments by turn: the last complete write wins
        self._open: dict[
            int, tuple[int, list[bytes], Mapping[str, str]]
        ] = {}  # turn -> (n parts, bodies, headers)

    def add(self, turn: int, headers: Mapping[str, str] | None, body: bytes) -> None:
        """One message of turn `turn`. Raises ContextLogError for headers that do not describe a part."""
        h = headers or {}
        part = h.get(HEADER_PART, "")
        i_s, _, n_s = part.partition("/")
        if not (i_s.isdigit() and n_s.isdigit()) or not 0 <= int(i_s) < int(n_s):
            raise ContextLogError(self.traj_id, turn, f"header {HEADER_PART} is {part!r}, not 'i/n'")
        i, n = int(i_s), int(n_s)
        if i == 0:
            self._open[turn] = (n, [], h)
        current = self._open.get(turn)
        if current is None or current[0] != n or len(current[1]) != i:
            self._open.pop(turn, None)  # a part out of its write's order: that write is incomplete
            return
        current[1].append(body)
        if len(current[1]) < n:
            return
        del self._open[turn]
        first = current[2]
        ids = unpack(b"".join(current[1]), self.traj_id, turn)
        expected = _int_header(first, HEADER_TOKENS, self.traj_id, turn)
        if len(ids) != expected:
            raise ContextLogError(
                self.traj_id, turn, f"{len(ids)} ids in the parts, {HEADER_TOKENS} says {expected}"
            )
        self.segments[turn] = Segment(
            turn,
            _int_header(first, HEADER_PREFIX_TURN, self.traj_id, turn),
            _int_header(first, HEADER_PREFIX_LEN, self.traj_id, turn),
            ids,
        )


def rebuild(
    traj_id: str,
    turn: int,
    segments: Mapping[int, Segment],
    known: Mapping[int, Sequence[int]] | None = None,
) -> array:
    """The whole prompt of turn `turn` from `segments`, stopping early at a turn whose prompt is `known`.

    Raises ContextLogError naming the first turn of the chain that is missing or refers past its prefix's end."""
    chain: list[Segment] = []
    base: array = array("I")
    t = turn
    while True:
        if known is not None and t in known and t != turn:
            base = array("I", known[t])
            break
        seg = segments.get(t)
        if seg is None:
            why = "not in the context log (never written, purged, or expired)"
            raise ContextLogError(traj_id, turn, f"the segment of turn {t} is {why}")
        chain.append(seg)
        if seg.prefix_len == 0:
            break
        if seg.prefix_turn >= t:  # turns only go back, so the chain ends
            raise ContextLogError(
                traj_id, turn, f"turn {t} refers to turn {seg.prefix_turn}, not an earlier turn"
            )
        t = seg.prefix_turn
    prompt = base  # our own array: built in place (a copy per turn would cost the square of the turns)
    for seg in reversed(chain):
        if seg.prefix_len > len(prompt):
            raise ContextLogError(
                traj_id,
                turn,
                f"turn {seg.turn} keeps {seg.prefix_len} tokens of turn {seg.prefix_turn}, whose prompt has {len(prompt)}",
            )
        del prompt[seg.prefix_len :]
        prompt.extend(seg.ids)
    return prompt

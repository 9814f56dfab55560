"""The Mooncake conversation trace, turned into multi-turn conversations.

Each request has a `timestamp` (ms), `input_length`, `output_length` and `hash_ids`, one id per 512-token block of
its input; equal leading ids mean an equal prefix. A conversation's next turn re-sends the whole history, so its
hash_ids begin with every *complete* block of the previous turn's input. The chaining rule:

* Requests are taken in timestamp order. An open conversation is keyed by the complete blocks of its latest
  request's input (`input_length // 512` leading ids).
* A request whose hash_ids begin with an open key of at least `MIN_SHARED_BLOCKS` blocks is that conversation's
  next turn (the longest such key wins), and the conversation's key moves to the new request. Block 0 is the system
  prompt every request in this trace shares, so one shared block says nothing about the conversation.
* Any other request opens a new conversation; so does a second request continuing the same turn (a fork or a
  regeneration), since the key has moved on.

Per turn: new prompt tokens = input_k - (input_{k-1} + output_{k-1}), the part of the prompt beyond the cached
history (turn 0: the whole input); a negative value (the client dropped part of the history) is clamped to 0 and
counted. Tool latency of turn k-1 = timestamp_k - timestamp_{k-1}: the user's think time *plus* the original
service time of turn k-1, an upper bound on the "tool" time. The conversation arrives at its first request;
`prefix_blocks` keeps the first request's hash_ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prorsa.workload.errors import WorkloadError
from prorsa.workload.trace import MOONCAKE_FILE, Trace, memoised, open_text, parse_int, shipped_path
from prorsa.workload.types import TrajectorySpec, Turn

BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces
MIN_SHARED_BLOCKS = 2  # more than the system-prompt block every request shares
TASK = "conversation"


@dataclass(frozen=True, slots=True)
class _Request:
    line: int
    timestamp_ms: int
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


@dataclass(slots=True)
class _Conversation:
    requests: list[_Request] = field(default_factory=list)


def load_mooncake_trace(path: str | Path | None = None) -> Trace:
    """The shipped Mooncake conversation trace, or any JSONL file with its fields (memoised per path).

    Raises WorkloadError (file:line) on a line that is not a JSON object with the four fields, or an empty file.
    """
    return memoised("mooncake", path if path is not None else shipped_path(MOONCAKE_FILE), _parse)


def _parse(path: Path) -> Trace:
    requests = sorted(_read(path), key=lambda r: (r.timestamp_ms, r.line))
    if not requests:
        raise WorkloadError(f"{path}:1: no requests")
    conversations = _chain(requests)
    clamped = 0
    trajectories = []
    for n, conv in enumerate(conversations):
        traj, negatives = _trajectory(f"conv{n}", conv.requests)
        trajectories.append(traj)
        clamped += negatives
    notes = [f"{path.name}: {len(requests)} requests chained into {len(trajectories)} conversations"]
    if clamped:
        notes.append(
            f"{path.name}: {clamped} turns whose input shrank below the history had new tokens set to 0"
        )
    return Trace(path.name, TASK, tuple(trajectories), timed=True, notes=tuple(notes))


def _read(path: Path) -> list[_Request]:
    requests = []
    with open_text(path) as handle:
        try:
            for line, text in enumerate(handle, start=1):
                if text.strip():
                    requests.append(_request(path, line, text))
        except (UnicodeDecodeError, EOFError, OSError) as exc:
            raise WorkloadError(f"{path}: unreadable: {exc}") from exc
    return requests


def _request(path: Path, line: int, text: str) -> _Request:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}:{line}: not JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise WorkloadError(f"{path}:{line}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise WorkloadError(f"{path}:{line}: missing field(s) {', '.join(missing)}")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(type(h) is int for h in hash_ids):
        raise WorkloadError(f"{path}:{line}: hash_ids must be a list of integers")
    return _Request(
        line=line,
        timestamp_ms=parse_int(path, line, "timestamp", obj["timestamp"]),
        input_tokens=parse_int(path, line, "input_length", obj["input_length"]),
        output_tokens=parse_int(path, line, "output_length", obj["output_length"]),
        hash_ids=tuple(hash_ids),
    )


def _chain(requests: Sequence[_Request]) -> list[_Conversation]:
    """Group requests into conversations by the rule in the module docstring."""
    conversations: list[_Conversation] = []
    # Open keys indexed by their last block id, so a request checks one dict entry per block it holds.
    open_by_last: dict[int, list[tuple[tuple[int, ...], int]]] = {}
    for req in requests:
        conv_no = _match(req.hash_ids, open_by_last)
        if conv_no is None:
            conv_no = len(conversations)
            conversations.append(_Conversation())
        else:
            old_key = _key(conversations[conv_no].requests[-1])
            open_by_last[old_key[-1]].remove((old_key, conv_no))
        conversations[conv_no].requests.append(req)
        key = _key(req)
        if len(key) >= MIN_SHARED_BLOCKS:
            open_by_last.setdefault(key[-1], []).append((key, conv_no))
    return conversations


def _key(req: _Request) -> tuple[int, ...]:
    return req.hash_ids[: req.input_tokens // BLOCK_TOKENS]


def _match(
    hash_ids: tuple[int, ...], open_by_last: dict[int, list[tuple[tuple[int, ...], int]]]
) -> int | None:
    for k in range(len(hash_ids), MIN_SHARED_BLOCKS - 1, -1):
        for key, conv_no in open_by_last.get(hash_ids[k - 1], ()):
            if len(key) == k and hash_ids[:k] == key:
                return conv_no
    return None


def _trajectory(traj_id: str, requests: list[_Request]) -> tuple[TrajectorySpec, int]:
    turns = []
    negatives = 0
    for k, req in enumerate(requests):
        if k == 0:
            new = req.input_tokens
        else:
            prev = requests[k - 1]
            new = req.input_tokens - prev.input_tokens - prev.output_tokens
            negatives += new < 0
        last = k == len(requests) - 1
        gap_s = 0.0 if last else (requests[k + 1].timestamp_ms - req.timestamp_ms) / 1000.0
        turns.append(Turn(max(new, 0), max(req.output_tokens, 1), gap_s))
    first = requests[0]
    traj = TrajectorySpec(
        traj_id=traj_id,
        task=TASK,
        turns=tuple(turns),
        arrival_s=first.timestamp_ms / 1000.0,
        prefix_blocks=first.hash_ids,
    )
    return traj, negatives

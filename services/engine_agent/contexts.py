"""Turns a lean request (a prefix reference plus new ids) into the whole prompt the backend runs.

Where the prefix comes from, cheapest first: this engine's `ContextCache` (it served the referenced turn: nothing
read), else the segments of the trajectory's context log (`proto/context_log.py`) after the turn the engine holds
(read from where it last read the log), else the whole log, which survives any engine, so a redelivered, migrated
or handed-off turn resolves on whichever engine takes it.

Errors: `ContextLogError` (a `ValueError`) when the log cannot give the prompt — a segment missing (purged,
expired, never written) or inconsistent with the request: the turn can never run, and the runner fails it with
that reason. Bus errors pass through: the runner redelivers the turn (the log may be back in a moment).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

import msgspec
from nats.aio.client import Client as NATS

from proto import GenerateRequest, Subjects
from proto.context_log import ContextLogError, ids_array, rebuild
from services.engine_agent.context_cache import ContextCache
from services.runtime.context_log_io import LogRead, read_segments


def needs_log(req: GenerateRequest) -> bool:
    """Whether the request's prompt is not all inline: it refers to an earlier turn, or its ids are in the log."""
    return req.prefix_len > 0 or (req.context_logged and not req.prompt_token_ids and req.prompt_len > 0)


class ContextResolver:
    def __init__(self, nc: Callable[[], NATS], subjects: Subjects, cache: ContextCache) -> None:
        self._nc = nc  # the agent's connection, looked up when needed (it exists once connected)
        self.subjects = subjects
        self.cache = cache
        self.log_reads = 0  # reads of a trajectory's log (the prompt was not held here)
        self.log_read_errors = 0
        self.partial_misses = 0  # reads from the last position that lacked a segment, then read whole
        self._last_seq: dict[str, int] = {}  # traj_id -> last sequence read while resolving its current turn

    async def resolve(self, req: GenerateRequest) -> GenerateRequest:
        """`req` with its whole prompt in `prompt_token_ids` and no prefix reference (unchanged when nothing is to
        resolve). Raises ContextLogError (see the module doc)."""
        if not needs_log(req):
            if req.context_logged and req.prompt_token_ids:  # a later turn may refer to this one
                self.cache.put(req.traj_id, req.turn, _ids(req, req.prompt_token_ids))
            return req
        # A redelivery to the engine that ran it finds the turn itself held.
        prompt = self.cache.get(req.traj_id, req.turn, req.prompt_len)
        try:
            if prompt is None:
                prompt = await self._build(req)
        finally:
            seq = self._last_seq.pop(req.traj_id, 0)
        if len(prompt) != req.prompt_len:
            why = f"it has {len(prompt)} tokens, the request's prompt_len is {req.prompt_len}"
            raise ContextLogError(req.traj_id, req.turn, why)
        self.cache.put(req.traj_id, req.turn, prompt)
        if seq > 0:
            self.cache.read_log(req.traj_id, seq)
        return msgspec.structs.replace(
            req, prompt_token_ids=prompt[: req.prompt_len].tolist(), prefix_turn=0, prefix_len=0
        )

    async def _build(self, req: GenerateRequest) -> array:
        inline = bool(req.prompt_token_ids) or req.prompt_len == req.prefix_len  # else the ids are in the log
        if req.prefix_len and req.prefix_turn >= req.turn:
            why = f"prefix_turn {req.prefix_turn} is not an earlier turn"
            raise ContextLogError(req.traj_id, req.turn, why)
        if not inline:
            return await self._from_log(req, req.turn)
        base = self.cache.get(req.traj_id, req.prefix_turn, req.prefix_len)
        if base is None:
            base = await self._from_log(req, req.prefix_turn)
        if len(base) < req.prefix_len:
            why = f"it keeps {req.prefix_len} tokens of turn {req.prefix_turn}, whose prompt has {len(base)}"
            raise ContextLogError(req.traj_id, req.turn, why)
        prompt = base[: req.prefix_len]
        prompt.extend(_ids(req, req.prompt_token_ids))
        return prompt

    async def _from_log(self, req: GenerateRequest, turn: int) -> array:
        """Turn `turn`'s prompt of the request's trajectory: from the segments after this engine's last read when
        they suffice (with the prompt it holds), else from the whole log."""
        after = self.cache.log_seq(req.traj_id)
        known = self.cache.known(req.traj_id)
        if after:
            read = await self._read(req, after)
            try:
                return rebuild(req.traj_id, turn, read.segments, known)
            except ContextLogError:
                self.partial_misses += (
                    1  # the chain reaches before that read (a rewritten history): read it all
                )
        read = await self._read(req, 0)
        return rebuild(req.traj_id, turn, read.segments, known)

    async def _read(self, req: GenerateRequest, after_seq: int) -> LogRead:
        self.log_reads += 1
        try:
            read = await read_segments(self._nc(), self.subjects, req.traj_id, after_seq)
        except ContextLogError:
            self.log_read_errors += 1
            raise
        self._last_seq[req.traj_id] = read.last_seq
        return read


def _ids(req: GenerateRequest, ids: Sequence[int]) -> array:
    try:
        return ids_array(ids)
    except ValueError as exc:  # a peer's ids (negative, or past 32 bits): the turn can never run
        raise ContextLogError(req.traj_id, req.turn, str(exc)) from None

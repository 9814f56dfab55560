"""Assemble one request's token stream from `TokenChunk`s, exactly once.

Pure (no I/O). The rules, which make redelivery, migration and client retries harmless:
- a chunk is identified by (request_id, index); a duplicate index is dropped;
- chunks may arrive out of order; the stream is read in index order, and it is complete when every index up to
  the final chunk's has arrived;
- chunks name their execution (`TokenChunk.stream`, one engine job) and where it started (`stream_base`). The
  stream follows one chain of executions: chunk 0 of a fresh execution (base 0) means the request restarted from
  scratch (its engine died and JetStream redelivered it, maybe to a replacement with the same id): everything
  received so far is discarded; a migrated request's execution (base = the next index) continues the chain where
  the current execution stopped; any other chunk of another execution (a concurrent duplicate run, after a
  redelivery to a second engine) is ignored, so two runs are never spliced. Chunks from older engines (no
  `stream`) restart on chunk 0 from another engine id;
- each attempt (`TokenChunk.attempt`: a client retry) is assembled on its own: chunk boundaries depend on timing,
  so index k of one attempt need not hold the tokens of index k of another; the first attempt to complete is the
  result;
- once complete, the result is frozen: later chunks (a late duplicate attempt) change nothing;
- every chunk names the policy version that sampled its tokens: the result's `token_versions` repeat it over them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto import TokenChunk


@dataclass(frozen=True, slots=True)
class GenerateResult:
    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    engine_id: str  # engine that finished the decode
    prefill_engine: str  # engine holding the prompt's prefix (affinity for the next turn)
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    e2e_s: float
    policy_version: int
    restarts: int  # times the stream restarted from scratch (engine loss)
    error: str = ""
    # Per output token, the `sampling.top_logprobs` most likely (token id, logprob), the most likely first; None
    # when not asked for (or an engine sent a chunk without them).
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # The policy version whose weights sampled each output token, aligned with `token_ids` (each chunk's version
    # over its tokens: a chunk never spans two). A turn that straddles an in-flight update holds two versions.
    token_versions: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Attempt:
    """The stream of one attempt."""

    chunks: dict[int, TokenChunk] = field(default_factory=dict)
    engine_id: str = ""
    stream: str = ""  # the execution the stream follows now
    final_index: int | None = None
    restarts: int = 0

    def fate(self, chunk: TokenChunk) -> str:
        """ "take", "restart" (discard what came so far, then take), "switch" (a continuation: take, follow it) or
        "ignore" (see the module doc)."""
        if not chunk.stream or not self.stream:  # the first chunk, or an older sender
            if chunk.index == 0 and 0 in self.chunks and self.engine_id and chunk.engine_id != self.engine_id:
                return "restart"
            return "take"
        if chunk.stream == self.stream:
            return "take"
        if chunk.stream_base == 0:
            return "restart" if chunk.index == 0 else "ignore"
        top = max(self.chunks, default=-1)
        return "switch" if chunk.stream_base == top + 1 else "ignore"

    def complete(self) -> bool:
        f = self.final_index
        return f is not None and len(self.chunks) >= f + 1 and all(i in self.chunks for i in range(f + 1))


@dataclass(slots=True)
class StreamAssembler:
    request_id: str
    attempts: dict[int, _Attempt] = field(default_factory=dict)
    latest: int = 0  # the newest attempt seen
    duplicates: int = 0
    result: GenerateResult | None = None

    @property
    def _current(self) -> _Attempt:
        return self.attempts.setdefault(self.latest, _Attempt())

    # The newest attempt's view (what a caller deciding whether to retry cares about).
    @property
    def chunks(self) -> dict[int, TokenChunk]:
        return self._current.chunks

    @property
    def final_index(self) -> int | None:
        return self._current.final_index

    @property
    def engine_id(self) -> str:
        return self._current.engine_id

    @property
    def restarts(self) -> int:
        return sum(a.restarts for a in self.attempts.values())

    def add(self, chunk: TokenChunk) -> GenerateResult | None:
        """Take one chunk; return the result the first time the stream becomes complete, else None."""
        if self.result is not None or chunk.request_id != self.request_id:
            self.duplicates += 1
            return None
        self.latest = max(self.latest, chunk.attempt)
        a = self.attempts.setdefault(chunk.attempt, _Attempt())
        fate = a.fate(chunk)
        if fate == "ignore":
            self.duplicates += 1
            return None
        if fate == "restart":
            a.chunks.clear()
            a.final_index = None
            a.restarts += 1
        if chunk.index in a.chunks:
            self.duplicates += 1
            return None
        a.chunks[chunk.index] = chunk
        if chunk.index == 0 or not a.engine_id:
            a.engine_id = chunk.engine_id
        if fate != "take" or not a.stream:
            a.stream = chunk.stream
        if chunk.finished:
            a.final_index = chunk.index
        if not a.complete():
            return None
        self.result = self._assemble(a)
        return self.result

    @property
    def tokens_so_far(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks.values())

    def _assemble(self, a: _Attempt) -> GenerateResult:
        assert a.final_index is not None
        ordered = [a.chunks[i] for i in range(a.final_index + 1)]
        last = ordered[-1]
        tokens = [t for c in ordered for t in c.token_ids]
        versions = [c.policy_version for c in ordered for _ in c.token_ids]
        logprobs: list[float] | None = None
        if all(c.logprobs is not None or not c.token_ids for c in ordered):  # a chunk of no tokens needs none
            logprobs = [lp for c in ordered for lp in (c.logprobs or [])]
        top: list[list[tuple[int, float]]] | None = None
        if any(c.top_logprobs for c in ordered) and all(
            c.top_logprobs is not None or not c.token_ids for c in ordered
        ):
            top = [list(alts) for c in ordered for alts in (c.top_logprobs or [])]
        return GenerateResult(
            request_id=self.request_id,
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=last.finish_reason,
            engine_id=last.engine_id,
            prefill_engine=last.prefill_engine,
            prompt_tokens=last.prompt_tokens,
            cached_tokens=last.cached_tokens,
            ttft_s=last.ttft_s,
            e2e_s=last.e2e_s,
            policy_version=last.policy_version,
            restarts=self.restarts,
            error=last.error,
            top_logprobs=top,
            token_versions=versions,
        )

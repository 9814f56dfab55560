"""Assemble one request's token stream from `TokenChunk`s, exactly once.

Pure (no I/O). The rules, which make redelivery, migration and client retries harmless:
- a chunk is identified by (request_id, index); a duplicate index is dropped;
- chunks may arrive out of order; the stream is read in index order, and it is complete when every index up to
  the final chunk's has arrived;
- a chunk with index 0 from an engine other than the one streaming means the request restarted from scratch (its
  first engine died and JetStream redelivered it): everything received so far is discarded;
- a migrated request continues on another engine from `next_chunk_index`, so its chunks simply follow on;
- once complete, the result is frozen: later chunks (a late duplicate attempt) change nothing.
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


@dataclass(slots=True)
class StreamAssembler:
    request_id: str
    chunks: dict[int, TokenChunk] = field(default_factory=dict)
    engine_id: str = ""
    final_index: int | None = None
    restarts: int = 0
    duplicates: int = 0
    result: GenerateResult | None = None

    def add(self, chunk: TokenChunk) -> GenerateResult | None:
        """Take one chunk; return the result the first time the stream becomes complete, else None."""
        if self.result is not None or chunk.request_id != self.request_id:
            self.duplicates += 1
            return None
        if chunk.index == 0 and self.engine_id and chunk.engine_id != self.engine_id and 0 in self.chunks:
            self.chunks.clear()
            self.final_index = None
            self.restarts += 1
        if chunk.index in self.chunks:
            self.duplicates += 1
            return None
        self.chunks[chunk.index] = chunk
        if chunk.index == 0 or not self.engine_id:
            self.engine_id = chunk.engine_id
        if chunk.finished:
            self.final_index = chunk.index
        if self.final_index is None or len(self.chunks) < self.final_index + 1:
            return None
        if any(i not in self.chunks for i in range(self.final_index + 1)):
            return None
        self.result = self._assemble()
        return self.result

    @property
    def tokens_so_far(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks.values())

    def _assemble(self) -> GenerateResult:
        assert self.final_index is not None
        ordered = [self.chunks[i] for i in range(self.final_index + 1)]
        last = ordered[-1]
        tokens = [t for c in ordered for t in c.token_ids]
        logprobs: list[float] | None = None
        if all(c.logprobs is not None for c in ordered):
            logprobs = [lp for c in ordered for lp in (c.logprobs or [])]
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
        )

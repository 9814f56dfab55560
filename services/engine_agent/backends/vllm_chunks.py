"""vLLM's streamed `RequestOutput`s (DELTA kind) as the backend's `EngineChunk`s: tokens, logprobs, timings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineChunk:
    """Output of one request since its previous chunk."""

    request_id: str
    token_ids: list[int]  # new output token ids, in order (may be empty on a final chunk)
    # Logprob of each new token under the model's raw distribution; None when not asked for.
    logprobs: list[float] | None
    finished: bool
    finish_reason: str  # "" until finished; then "length" | "stop" | "abort" | "error" (vLLM's strings)
    num_prompt_tokens: int
    # Prompt tokens not computed by this request's prefill: local prefix-cache hits; on a remote decode, the
    # prefill engine's hits as vLLM reports them (the pulled tokens themselves are not counted).
    num_cached_tokens: int
    num_output_tokens: int  # output tokens so far, this chunk included
    ttft_s: float | None  # submit -> first token on this engine's wall clock; None before it
    elapsed_s: float  # submit -> this chunk
    kv_transfer_params: dict[str, Any] | None = None  # final chunk of a prefill for remote decode
    # Per new token, the k most likely (token id, logprob) by vLLM's rank, the most likely first (k: the request's
    # top_logprobs); None when k is 0.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # The policy version that sampled each token (vLLM's weight-version labels, `vllm_weights.token_versions`);
    # None where vLLM has no label of ours.
    token_versions: list[int] | None = None


def _plain(value: Any) -> Any:
    """kv_transfer_params as plain JSON/msgpack types (vLLM may hand back tuples)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def top_k(entry: Mapping[int, Any], k: int) -> list[tuple[int, float]]:
    """The k best of one position's vLLM logprobs (`{token id: Logprob}`: the top k by rank, plus the sampled
    token at its own rank when it is not among them), the most likely first."""
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
    return [(int(t), float(lp.logprob)) for t, lp in ranked if lp.rank is None or lp.rank <= k][:k]


class StreamState:
    """Turns one request's DELTA `RequestOutput`s into `EngineChunk`s."""

    def __init__(self, request_id: str, num_prompt_tokens: int, top_logprobs: int = 0) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.top_logprobs = top_logprobs  # k alternatives per token (0: none)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.ttft_s: float | None = None

    def chunk(self, out: Any, elapsed_s: float) -> EngineChunk:
        completion = out.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = top = None
        if completion.logprobs is not None:
            logprobs = [
                float(entry[tok].logprob) for entry, tok in zip(completion.logprobs, token_ids, strict=True)
            ]
            if self.top_logprobs > 0:
                top = [top_k(entry, self.top_logprobs) for entry in completion.logprobs]
        if out.num_cached_tokens is not None:
            self.num_cached_tokens = int(out.num_cached_tokens)
        if token_ids and self.ttft_s is None:
            self.ttft_s = elapsed_s
        self.num_output_tokens += len(token_ids)
        kv_params = out.kv_transfer_params
        return EngineChunk(
            request_id=self.request_id,
            token_ids=token_ids,
            logprobs=logprobs,
            finished=bool(out.finished),
            finish_reason=str(completion.finish_reason or "") if out.finished else "",
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=self.num_output_tokens,
            ttft_s=self.ttft_s,
            elapsed_s=elapsed_s,
            kv_transfer_params=_plain(kv_params) if (out.finished and kv_params) else None,
            top_logprobs=top,
        )

    def final(self, reason: str, elapsed_s: float) -> EngineChunk:
        return EngineChunk(
            request_id=self.request_id,
            token_ids=[],
            logprobs=None,
            finished=True,
            finish_reason=reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=self.num_output_tokens,
            ttft_s=self.ttft_s,
            elapsed_s=elapsed_s,
        )

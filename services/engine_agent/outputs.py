"""The messages a job sends, built from its state (pure: times are parameters, nothing is published here).

Times: `now_s` is the agent's `Clock.now_s()` (Unix time in scaled seconds, comparable with the client's
`submitted_s`), `now_mono` the scaled monotonic clock the job's stream times were taken on. A request's latencies count from `submitted_s` when the
client set it, else from when this engine pulled it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from proto import DecodeHandoff, GenerateRequest, TokenChunk
from services.engine_agent.backend import PrefillResult
from services.engine_agent.jobs import Job


def _origin_s(job: Job) -> float:
    return job.request.submitted_s if job.request.submitted_s > 0 else job.pulled_wall_s


def _ttft_s(job: Job, now_s: float, now_mono: float) -> float:
    """Submission → first token streamed here; 0 for a migrated request (its first token came from elsewhere)."""
    if job.first_stream_mono is None or job.request.resume_token_ids:
        return 0.0
    return max(0.0, now_s - (now_mono - job.first_stream_mono) - _origin_s(job))


def token_chunk(
    job: Job,
    index: int,
    ids: list[int],
    logprobs: list[float] | None,
    *,
    engine_id: str,
    final: bool = False,
    reason: str = "",
    policy_version: int = 0,
    now_s: float = 0.0,
    now_mono: float = 0.0,
    top_logprobs: list[list[tuple[int, float]]] | None = None,
) -> TokenChunk:
    """Chunk `index` of the job's stream, its tokens sampled by `policy_version`; the final one carries the
    request's totals and latencies."""
    req = job.request
    extra: dict[str, Any] = {}
    if final:
        extra = {
            "prompt_tokens": req.prompt_len,
            "cached_tokens": job.cached_tokens,
            "output_tokens": job.output_tokens,
            "ttft_s": _ttft_s(job, now_s, now_mono),
            "e2e_s": max(0.0, now_s - _origin_s(job)),
            "prefill_engine": job.prefill_engine,
        }
    # Logprobs only when asked for and complete (a handed-off first token may come without one).
    keep = req.sampling.logprobs and logprobs is not None and len(logprobs) == len(ids)
    keep_top = req.sampling.top_logprobs > 0 and top_logprobs is not None and len(top_logprobs) == len(ids)
    return TokenChunk(
        request_id=req.request_id,
        index=index,
        token_ids=list(ids),
        logprobs=list(logprobs) if keep and logprobs is not None else None,
        finished=final,
        finish_reason=reason,
        engine_id=engine_id,
        attempt=req.attempt,
        stream=job.stream_tag,
        stream_base=req.next_chunk_index,
        top_logprobs=[list(t) for t in top_logprobs] if keep_top and top_logprobs is not None else None,
        policy_version=policy_version,  # every chunk: the version that sampled its tokens
        **extra,
    )


def error_chunk(request: GenerateRequest, index: int, error: str, engine_id: str) -> TokenChunk:
    """The final chunk of a request that failed: no tokens, finish_reason "error", and why."""
    return TokenChunk(
        request_id=request.request_id,
        index=index,
        token_ids=[],
        finished=True,
        finish_reason="error",
        engine_id=engine_id,
        prompt_tokens=request.prompt_len,
        error=error,
        attempt=request.attempt,
    )


def finished_fields(
    job: Job, reason: str, policy_version: int, now_s: float, now_mono: float
) -> dict[str, Any]:
    """The fields of the job's RequestFinished event (engine id, time and seq are the agent's)."""
    req = job.request
    return {
        "request_id": req.request_id,
        "traj_id": req.traj_id,
        "turn": req.turn,
        "prompt_tokens": req.prompt_len,
        "cached_tokens": job.cached_tokens,
        "output_tokens": job.output_tokens,
        "finish_reason": reason or "length",
        "queue_s": max(0.0, job.pulled_wall_s - req.submitted_s) if req.submitted_s > 0 else 0.0,
        "ttft_s": _ttft_s(job, now_s, now_mono),
        "e2e_s": max(0.0, now_s - _origin_s(job)),
        "policy_version": policy_version,
    }


def decode_handoff(
    job: Job, res: PrefillResult, engine_id: str, now_s: float, policy_version: int = 0
) -> DecodeHandoff:
    """The handoff a prefill engine enqueues for a decode engine; `policy_version`: the weights that computed its KV
    and sampled its first token."""
    return DecodeHandoff(
        request=job.request,
        prefill_engine=engine_id,
        first_token_id=res.first_token_id,
        first_logprob=res.first_logprob,
        first_top_logprobs=res.first_top_logprobs,
        kv_transfer_params=res.kv_transfer_params,
        kv_tokens=job.context_tokens,
        prefill_new_tokens=res.new_tokens,
        prefill_cached_tokens=res.cached_tokens,
        handed_off_s=now_s,
        policy_version=policy_version,
    )


def migrated_request(job: Job) -> GenerateRequest:
    """The request that continues the job elsewhere: same request_id and whole-turn max_tokens, everything
    streamed so far as resume tokens, chunks numbered on from the next index, no affinity."""
    req = job.request
    return msgspec.structs.replace(
        req,
        resume_token_ids=[*req.resume_token_ids, *job.streamed_ids],
        next_chunk_index=job.next_index,
        affinity_engine="",
        resume_min_version=job.min_version if job.min_version is not None else 0,
    )


def hand_on_msg_id(job: Job, migrated: GenerateRequest | None) -> str:
    """JetStream de-duplication id of a hand-on publish: unique per migration (resume length only grows) or per
    original message (its stream sequence), so a retried publish is dropped and distinct hand-ons are not."""
    req = job.request
    if migrated is not None:
        return f"{req.request_id}#{req.attempt}:m{len(migrated.resume_token_ids)}"
    return f"{req.request_id}#{req.attempt}:q{job.stream_seq}"

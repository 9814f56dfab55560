"""One unit of work an engine holds (a pulled JetStream message), and the checks a request must pass first.

A `Job` lives from the moment its message is pulled until the message is acked (done, or handed on) or the engine
dies (then JetStream redelivers it). Kinds: `prefill` (prefill role: prefill, then hand the KV to a decode engine),
`decode` (a DecodeHandoff: pull the KV, stream the rest) and `generate` (mixed role: prefill and decode here).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from proto import DecodeHandoff, GenerateRequest
from services.engine_agent.switch_rule import JobKind

Phase = Literal["queued", "prefill", "decode", "done"]
Outcome = Literal["", "finished", "handed_off", "migrated", "requeued", "failed", "retried"]

# A reply subject the engine may publish to: dot-separated non-empty tokens, no whitespace or wildcards, and not a
# system subject ("$JS.API...", "$SYS..."): a hostile reply_to must not turn our token stream into an API call.
_REPLY_SUBJECT = re.compile(r"^[^\s.*>$\x00-\x1f\x7f][^\s.*>\x00-\x1f\x7f]*(\.[^\s.*>\x00-\x1f\x7f]+)*$")
MAX_SUBJECT_LEN = 512


@dataclass(eq=False)
class Job:
    kind: JobKind
    request: GenerateRequest
    msg: Any  # nats Msg to ack; replaced when JetStream redelivers the same message while it runs
    stream_seq: int  # the message's sequence in the WORK stream: what a redelivery shares with the original
    expected_tokens: int  # whole-turn output the backend expects
    pulled_wall_s: float  # the agent's clock.now_s() when pulled (Unix time, scaled seconds)
    pulled_mono: float  # the agent's clock.monotonic_s() when pulled (scaled seconds)
    handoff: DecodeHandoff | None = None
    kv_reserved_tokens: int = 0
    next_index: int = 0  # index of the next TokenChunk
    streamed_ids: list[int] = field(
        default_factory=list
    )  # tokens this engine streamed (after the resume ones)
    first_stream_mono: float | None = None
    last_stream_mono: float | None = None
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (for events and the final chunk)
    prefill_engine: str = ""
    phase: Phase = "queued"
    stop: bool = False  # asked to stop and hand the work on (role switch, shutdown)
    # Where a migration goes: the engine holding the turn's prefix ("" = the shared prefill queue), set by a
    # restarting engine's drain (switch_drain.py) before it stops the job.
    hand_on_to: str = ""
    aborted: bool = False  # stopped by an AbortRequest: ends with finish_reason "abort" instead of handing on
    outcome: Outcome = ""
    reported_tokens: int = -1  # output count in the last TokenProgress
    task: Any = None  # asyncio.Task running it
    # This execution of the request's stream (chunks carry it as `TokenChunk.stream`): a client seeing chunk 0 of
    # another execution knows the stream restarted, even when a replacement engine with the same id runs it.
    stream_tag: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # The request with its whole prompt (`contexts.py`), once resolved: what the backend runs. `request` stays the
    # lean request as it came, which is what a handoff, a requeue or a migration passes on.
    resolved: GenerateRequest | None = None
    # The oldest policy version among the turn's tokens so far (resumed ones included); None: no token yet.
    min_version: int | None = None

    def __post_init__(self) -> None:
        if self.request.resume_token_ids:
            self.min_version = self.request.resume_min_version

    def sampled(self, version: int) -> None:
        """Tokens sampled by `version` were streamed."""
        self.min_version = version if self.min_version is None else min(self.min_version, version)

    @property
    def backend_request(self) -> GenerateRequest:
        return self.resolved if self.resolved is not None else self.request

    @property
    def prefilled(self) -> bool:
        """Its prompt is prefilled (a handoff's was, elsewhere), so its engine only decodes it from here on."""
        return self.kind == "decode" or self.phase in ("decode", "done")

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def context_tokens(self) -> int:
        return self.request.prompt_len + len(self.request.resume_token_ids)

    @property
    def output_tokens(self) -> int:
        """Output of the whole turn so far: resumed tokens plus those streamed here."""
        return len(self.request.resume_token_ids) + len(self.streamed_ids)

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.expected_tokens - self.output_tokens)

    def s_per_token(self) -> float | None:
        """Observed inter-token time of this request here (scaled seconds), or None before two streamed tokens."""
        n = len(self.streamed_ids)
        if n < 2 or self.first_stream_mono is None or self.last_stream_mono is None:
            return None
        return max(0.0, self.last_stream_mono - self.first_stream_mono) / (n - 1)


def valid_reply_subject(subject: str) -> bool:
    return 0 < len(subject) <= MAX_SUBJECT_LEN and bool(_REPLY_SUBJECT.match(subject))


def request_problem(request: GenerateRequest, max_model_len: int) -> str:
    """Why the request can never run here ("" if it can). A bad request is failed, not retried."""
    if not valid_reply_subject(request.reply_to):
        return f"reply_to {request.reply_to[:80]!r} is not a subject the engine may publish to"
    if request.prefix_len > request.prompt_len:
        return f"prefix_len {request.prefix_len} exceeds prompt_len {request.prompt_len}"
    if request.prefix_len and request.prefix_turn >= request.turn:
        return f"prefix_turn {request.prefix_turn} is not a turn before turn {request.turn}"
    sent = request.prefix_len + len(request.prompt_token_ids)
    if request.prompt_token_ids and sent != request.prompt_len:
        return (
            f"prompt_len {request.prompt_len} differs from the {sent} tokens sent "
            f"({request.prefix_len} of turn {request.prefix_turn} and {len(request.prompt_token_ids)} ids)"
        )
    context = request.prompt_len + len(request.resume_token_ids)
    if context == 0:
        return "empty prompt"
    if context >= max_model_len:
        return f"prompt of {context} tokens exceeds max_model_len {max_model_len}"
    if len(request.resume_token_ids) > request.sampling.max_tokens:
        return (
            f"{len(request.resume_token_ids)} resumed tokens exceed max_tokens {request.sampling.max_tokens}"
        )
    return ""

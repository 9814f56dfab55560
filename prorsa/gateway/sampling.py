"""From an OpenAI/SGLang request's sampling fields to `proto.SamplingParams`, refusing what Prorsa cannot honour.

Pure. The rule (issue 29): a field a request sets that the engines cannot honour is a 400 naming it, never dropped
silently. What engines honour is `proto.SamplingParams`: max_tokens, temperature, top_p, top_k, seed, the sampled
token's logprob, stop token ids, ignore_eos. Stop *strings* are honoured here, at the gateway: the output is
detokenised and cut after the first stop string, at a token boundary (`cut_at_stop`).

Logprobs are the engine's *raw* logprobs (vLLM's default `logprobs_mode`: the model's log-softmax before
temperature, top-k/top-p or penalties), one per sampled token; a trainer recomputing its own logprobs compares with
raw ones. Top-k alternatives are not returned, so asking for them is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proto import SamplingParams

DEFAULT_MAX_TOKENS = 256
LOGPROBS_MODES = ("raw_logprobs",)  # what the engines return (see the module doc)


class UnsupportedField(ValueError):
    """A request field Prorsa cannot honour (HTTP 400 naming `field`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# field -> (the value that means "not asked for", why it is refused)
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "presence_penalty": (0.0, "penalties are not applied by Prorsa's engines"),
    "frequency_penalty": (0.0, "penalties are not applied by Prorsa's engines"),
    "repetition_penalty": (1.0, "penalties are not applied by Prorsa's engines"),
    "min_tokens": (0, "min_tokens is not applied by Prorsa's engines"),
    "min_p": (0.0, "min_p is not applied by Prorsa's engines"),
    "best_of": (None, "best_of is not supported; use n (a group of trajectories)"),
    "echo": (False, "echo is not supported"),
    "suffix": (None, "suffix is not supported"),
    "logit_bias": (None, "logit_bias is not supported"),
    "top_logprobs": (0, "top-k logprobs are not returned: only the sampled token's logprob"),
    "prompt_logprobs": (None, "prompt logprobs are not returned"),
    "guided_json": (None, "guided decoding is not supported"),
    "guided_regex": (None, "guided decoding is not supported"),
}


def refuse_unsupported(fields: dict[str, Any]) -> None:
    """Raise UnsupportedField for the first field set to anything but its neutral value."""
    for name, (neutral, why) in _NEUTRAL.items():
        value = fields.get(name)
        if value is None or value == neutral or (neutral is None and value in ({}, [], False, "")):
            continue
        raise UnsupportedField(name, f"{name}={value!r}: {why}")


@dataclass(frozen=True, slots=True)
class Sampling:
    """What one turn is sampled with: the engines' params and the gateway's stop strings."""

    params: SamplingParams
    stop: tuple[str, ...] = ()


def build_sampling(fields: dict[str, Any], max_tokens_cap: int) -> Sampling:
    """The turn's sampling from the request's fields (OpenAI names; None = not given). Raises UnsupportedField."""
    refuse_unsupported(fields)
    mode = fields.get("logprobs_mode")
    if mode is not None and mode not in LOGPROBS_MODES:
        raise UnsupportedField(
            "logprobs_mode", f"logprobs_mode={mode!r}: the engines return {', '.join(LOGPROBS_MODES)}"
        )
    max_tokens = fields.get("max_completion_tokens") or fields.get("max_tokens") or DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise UnsupportedField("max_tokens", f"max_tokens={max_tokens}: must be at least 1")
    max_tokens = min(max_tokens, max_tokens_cap)
    stop = fields.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in stops):
        raise UnsupportedField("stop", "stop strings must not be empty")
    top_p = fields.get("top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise UnsupportedField("top_p", f"top_p={top_p}: must be in (0, 1]")
    temperature = fields.get("temperature")
    if temperature is not None and temperature < 0:
        raise UnsupportedField("temperature", f"temperature={temperature}: must be >= 0")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        top_k=-1 if fields.get("top_k") in (None, 0) else int(fields["top_k"]),
        seed=fields.get("seed"),
        logprobs=True,  # always: RL needs them, and they cost the engine nothing extra
        stop_token_ids=list(fields.get("stop_token_ids") or []),
        ignore_eos=bool(fields.get("ignore_eos") or False),
    )
    return Sampling(params, stops)


def cut_at_stop(
    token_ids: list[int], stops: tuple[str, ...], decode: Callable[[list[int]], str]
) -> tuple[int, str] | None:
    """Where the output stops on a stop string: (tokens kept, text kept: up to, not including, the stop string),
    or None when no stop string occurs. Tokens are kept up to the first one whose text completes the stop string,
    so ids and logprobs stay exactly what was sampled (a token may hold text beyond the cut)."""
    if not stops:
        return None
    text = decode(token_ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return None
    at, stop = min(hits)
    end = at + len(stop)
    # The shortest prefix of tokens whose text reaches the end of the stop string (decode is monotone in practice).
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(token_ids[:mid])) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo, text[:at]

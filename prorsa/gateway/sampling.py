"""From an OpenAI/SGLang request's sampling fields to `proto.SamplingParams`, refusing what Prorsa cannot honour.

Pure. The rule (issue 29): a field a request sets that the engines cannot honour is a 400 naming it, never dropped
silently. What engines honour is `proto.SamplingParams`: max_tokens, min_tokens, temperature, top_p, top_k, seed,
the presence, frequency and repetition penalties, the sampled token's logprob and the top-k alternatives
(`top_logprobs`), the kind of logprobs (`logprobs_mode`), stop token ids, ignore_eos; their bounds are the
contract's (`checked_sampling`), so a value out of them is refused here, naming the field, before anything is sent.
Stop *strings* are honoured here, at the gateway: the output is detokenised and cut after the first stop string, at
a token boundary (`cut_at_stop`). Simulated engines take every field but have no logits: penalties change nothing
there (services/engine_agent/backends/sim_backend.py, "Sampling").

Logprobs. vLLM engines return one kind for the whole engine (its engine argument `logprobs_mode`): `raw_logprobs` by
default, the model's log-softmax before temperature, penalties and top-k/top-p, or `processed_logprobs`, those of the
distribution actually sampled from. A request's `logprobs_mode` ("raw_logprobs" or "processed_logprobs"; unset:
the engine's kind) is checked by the engine, which refuses a turn asking for the other kind (a 400 naming it).
Which one a trainer recomputes: log-softmax(logits / T) of the policy, the rollout temperature T applied (verl's
actor divides its logits by it) and no top-k/top-p or penalty. At T = 1 with none of those set, raw and processed
are the same numbers and either matches it; at T != 1 processed_logprobs is the one it recomputes, as long as no
top-k/top-p or penalty is set (they change processed logprobs, and no trainer recomputes them); raw_logprobs are
the policy's own at T = 1, whatever the sampler did.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prorsa.client.client import checked_sampling
from proto import LOGPROBS_MODES, SamplingParams

DEFAULT_MAX_TOKENS = 256
_FIELD = re.compile(r"at `\$\.(\w+)")


class UnsupportedField(ValueError):
    """A request field Prorsa cannot honour (HTTP 400 naming `field`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# field -> (the value that means "not asked for", why it is refused)
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "min_p": (0.0, "min_p is not applied by Prorsa's engines"),
    "best_of": (None, "best_of is not supported; use n (a group of trajectories)"),
    "echo": (False, "echo is not supported"),
    "suffix": (None, "suffix is not supported"),
    "logit_bias": (None, "logit_bias is not supported"),
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
    """The turn's sampling from the request's fields (OpenAI names; None = not given; `top_logprobs`: the k
    alternatives per token, whichever field of the endpoint asked for them). Raises UnsupportedField."""
    refuse_unsupported(fields)
    mode = fields.get("logprobs_mode")
    if mode is not None and mode not in LOGPROBS_MODES:
        raise UnsupportedField(
            "logprobs_mode",
            f"logprobs_mode={mode!r}: one of {', '.join(LOGPROBS_MODES)} (the engines return logprobs, not logits)",
        )
    max_tokens = fields.get("max_completion_tokens") or fields.get("max_tokens") or DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise UnsupportedField("max_tokens", f"max_tokens={max_tokens}: must be at least 1")
    min_tokens = fields.get("min_tokens") or 0
    if min_tokens > max_tokens:
        raise UnsupportedField("min_tokens", f"min_tokens={min_tokens} exceeds max_tokens={max_tokens}")
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

    def given(name: str, neutral: float) -> float:
        value = fields.get(name)
        return neutral if value is None else value

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        top_k=-1 if fields.get("top_k") in (None, 0) else int(fields["top_k"]),
        seed=fields.get("seed"),
        logprobs=True,  # always: RL needs them, and they cost the engine nothing extra
        stop_token_ids=list(fields.get("stop_token_ids") or []),
        ignore_eos=bool(fields.get("ignore_eos") or False),
        presence_penalty=given("presence_penalty", 0.0),
        frequency_penalty=given("frequency_penalty", 0.0),
        repetition_penalty=given("repetition_penalty", 1.0),
        min_tokens=min(min_tokens, max_tokens),
        top_logprobs=fields.get("top_logprobs") or 0,
        logprobs_mode=mode or "",
    )
    try:  # the contract's bounds, one rule in one place (proto/messages.py)
        params = checked_sampling(params)
    except ValueError as exc:
        at = _FIELD.search(str(exc))
        name = at.group(1) if at else "sampling"
        raise UnsupportedField(
            name, f"{name}={fields.get(name)!r}: {str(exc).removeprefix('sampling: ')}"
        ) from exc
    return Sampling(params, stops)


def cut_at_stop(
    token_ids: list[int], stops: tuple[str, ...], decode: Callable[[list[int]], str], min_tokens: int = 0
) -> tuple[int, str] | None:
    """Where the output stops on a stop string: (tokens kept, text kept: up to, not including, the stop string),
    or None when no stop string occurs. Tokens are kept up to the first one whose text completes the stop string,
    so ids and logprobs stay exactly what was sampled (a token may hold text beyond the cut). As in vLLM, a stop
    string completed within the first `min_tokens` tokens does not count: the output is never cut shorter."""
    if not stops:
        return None
    text = decode(token_ids)
    # A stop string counts when its end lies past the text of the first min_tokens - 1 tokens (its last character
    # then comes with token min_tokens or later).
    floor = len(decode(token_ids[: min_tokens - 1])) if min_tokens > 1 else 0
    hits = []
    for s in stops:
        at = text.find(s, max(0, floor - len(s) + 1))
        if at >= 0:
            hits.append((at, s))
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

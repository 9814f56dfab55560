"""Response bodies in OpenAI's (and SGLang's) shapes, with Prorsa's token-exact additions.

Pure. As vLLM's `return_token_ids` does: `prompt_token_ids` on the response (chat) or the choice (completions),
`token_ids` on each choice: exactly what was sampled, and `token_versions` beside them: the policy version that
sampled each (a turn that straddles an in-flight weight update holds two). Logprobs are the engine's, one per output token (see
`sampling.py` for which kind). `prorsa` names the trajectory, its turn, the engine and the policy version.
"""

from __future__ import annotations

import json
import time
from typing import Any

from prorsa.gateway.tool_parser import ToolCall
from prorsa.gateway.turns import Turn


def error_body(
    message: str, code: str, param: str | None = None, kind: str = "invalid_request_error"
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def prorsa_fields(turn: Turn) -> dict:
    return {
        "trajectory_id": turn.traj_id,
        "turn": turn.turn,
        "engine_id": turn.engine_id,
        "policy_version": turn.policy_version,
        "ttft_s": turn.ttft_s,
    }


def usage(turns: list[Turn]) -> dict:
    prompt = turns[0].prompt_ids if turns else []
    completion = sum(len(t.output_ids) for t in turns)
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": completion,
        "total_tokens": len(prompt) + completion,
        "prompt_tokens_details": {"cached_tokens": max((t.cached_tokens for t in turns), default=0)},
    }


def token_strings(ids: list[int], decode: Any) -> list[str]:
    return [decode([i]) or "" for i in ids] if decode is not None else [f"token_id:{i}" for i in ids]


# Per token, its (token id, logprob) alternatives, the most likely first (None: not asked for).
Top = list[list[tuple[int, float]]] | None


def _alternatives(top: Top, n: int) -> list[list[tuple[int, float]]]:
    return top if top is not None and len(top) == n else [[] for _ in range(n)]


def chat_logprobs(ids: list[int], logprobs: list[float] | None, decode: Any, top: Top = None) -> dict | None:
    """OpenAI's chat `logprobs`; each entry (and each of its `top_logprobs`) also carries its `token_id`."""
    if logprobs is None:
        return None
    tokens = token_strings(ids, decode)

    def entry(token_id: int, tok: str, lp: float) -> dict:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "token_id": token_id}

    content = []
    for i, tok, lp, alts in zip(ids, tokens, logprobs, _alternatives(top, len(ids)), strict=True):
        alt_tokens = token_strings([t for t, _ in alts], decode)
        tops = [entry(t, s, a) for (t, a), s in zip(alts, alt_tokens, strict=True)]
        content.append({**entry(i, tok, lp), "top_logprobs": tops})
    return {"content": content}


def chat_message(text: str | None, calls: list[ToolCall]) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = [c.as_openai() for c in calls]
    return msg


def chat_response(
    model: str,
    turns: list[Turn],
    messages: list[tuple[str | None, list[ToolCall]]],
    want_logprobs: bool,
    decode: Any,
) -> dict:
    choices = []
    for i, (turn, (content, calls)) in enumerate(zip(turns, messages, strict=True)):
        choices.append(
            {
                "index": i,
                "message": chat_message(content, calls),
                "finish_reason": "tool_calls" if calls else turn.finish_reason,
                "logprobs": (
                    chat_logprobs(turn.output_ids, turn.logprobs, decode, turn.top_logprobs)
                    if want_logprobs
                    else None
                ),
                "token_ids": turn.output_ids,
                "token_versions": list(turn.token_versions),
                "prorsa": prorsa_fields(turn),
            }
        )
    return {
        "id": f"chatcmpl-{turns[0].traj_id}-{turns[0].turn}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "prompt_token_ids": turns[0].prompt_ids,
        "choices": choices,
        "usage": usage(turns),
    }


def completion_logprobs(
    ids: list[int], logprobs: list[float] | None, decode: Any, top: Top = None
) -> dict | None:
    """OpenAI's completions `logprobs`. Its `top_logprobs` maps token *text* to logprob, so two ids with one text
    would collide: `top_token_ids` (Prorsa's) lists the same alternatives as [token id, logprob], in order."""
    if logprobs is None:
        return None
    tokens = token_strings(ids, decode)
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    body = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}
    if top is not None:
        alts = _alternatives(top, len(ids))
        body["top_logprobs"] = [
            dict(zip(token_strings([t for t, _ in a], decode), [lp for _, lp in a], strict=True))
            for a in alts
        ]
        body["top_token_ids"] = [[[t, lp] for t, lp in a] for a in alts]
    return body


def completion_response(model: str, turns: list[Turn], want_logprobs: bool, decode: Any) -> dict:
    return {
        "id": f"cmpl-{turns[0].traj_id}-{turns[0].turn}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "text": t.text or "",
                "finish_reason": t.finish_reason,
                "logprobs": (
                    completion_logprobs(t.output_ids, t.logprobs, decode, t.top_logprobs)
                    if want_logprobs
                    else None
                ),
                "prompt_token_ids": t.prompt_ids,
                "token_ids": t.output_ids,
                "token_versions": list(t.token_versions),
                "prorsa": prorsa_fields(t),
            }
            for i, t in enumerate(turns)
        ],
        "usage": usage(turns),
    }


def generate_response(turn: Turn, want_logprobs: bool) -> dict:
    """SGLang's `/generate` answer: `output_ids`, `text`, and `meta_info` (logprobs as (logprob, id, None); the
    top-k alternatives, when asked for, as a list of those per token)."""
    meta: dict[str, Any] = {
        "id": f"{turn.traj_id}:{turn.turn}",
        "finish_reason": {"type": turn.finish_reason},
        "prompt_tokens": len(turn.prompt_ids),
        "completion_tokens": len(turn.output_ids),
        "cached_tokens": turn.cached_tokens,
        "weight_version": turn.policy_version,
        "output_token_versions": list(turn.token_versions),
        "prorsa": prorsa_fields(turn),
    }
    if want_logprobs and turn.logprobs is not None:
        meta["output_token_logprobs"] = [
            [lp, i, None] for lp, i in zip(turn.logprobs, turn.output_ids, strict=True)
        ]
        if turn.top_logprobs is not None:
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in alts] for alts in turn.top_logprobs]
    return {"text": turn.text or "", "output_ids": turn.output_ids, "meta_info": meta}


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()

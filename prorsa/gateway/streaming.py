"""Server-sent events of a streamed turn, in OpenAI's chunk shapes (`chat.completion.chunk`, `text_completion`) and
SGLang's `/generate` shape.

Each engine chunk (its ids and their logprobs, as `TokenChunk`s arrive: `Trajectory.generate(on_chunk=)`) becomes
one event carrying `token_ids` (and `logprobs` when asked); text is decoded incrementally, held back while it ends
in a partial UTF-8 character, and held whole to the end when it may still change (`hold_text`: stop strings cut it,
tool calls are parsed from all of it). The last event has the finish reason, `prompt_token_ids` and `prorsa` (the
trajectory, turn, engine), then `[DONE]`.

SGLang's events (`generate_events`) are *cumulative*, as SGLang's server streams by default (without its
`incremental_streaming_output`): each holds the whole `text` and `output_ids` so far and a `meta_info` whose
`finish_reason` is null until the last event, which is exactly the whole answer `/generate` gives unstreamed. A
client keeps the last event; one cut at a stop string (the gateway's) may hold fewer ids than an event before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from prorsa.gateway import shapes
from prorsa.gateway.turns import Turn

Decode = Callable[[list[int]], str] | None


async def drain(queue: asyncio.Queue, task: asyncio.Task) -> AsyncIterator[Any]:
    """The chunks a running turn streams, until it ends (its own result or error is then the caller's)."""
    while True:
        if task.done() and queue.empty():
            return
        get = asyncio.ensure_future(queue.get())
        done, _ = await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            yield get.result()
        else:
            get.cancel()


def _new_text(ids: list[int], sent: str, decode: Decode) -> str:
    """Text of `ids` not yet sent ("" while the tail is a partial character or nothing new decoded)."""
    if decode is None:
        return ""
    text = decode(ids)
    if text.endswith("\ufffd") or not text.startswith(sent):
        return ""
    return text[len(sent) :]


async def chat_events(
    queue: asyncio.Queue,
    task: asyncio.Task,
    *,
    model: str,
    hold_text: bool,
    logprobs: bool,
    include_usage: bool,
    decode: Decode,
    message: Callable[[Turn], tuple[str | None, list]],
) -> AsyncIterator[bytes]:
    def frame(delta: dict, extra: dict, finish: str | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}
        return {
            "id": "chatcmpl-stream",
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [choice],
        }

    yield shapes.sse(frame({"role": "assistant", "content": ""}, {}))
    ids: list[int] = []
    sent = ""
    async for chunk in drain(queue, task):
        ids += chunk.token_ids
        delta: dict[str, Any] = {}
        if not hold_text and (new := _new_text(ids, sent, decode)):
            delta["content"], sent = new, sent + new
        out = frame(delta, _ids(chunk))
        if logprobs:
            out["choices"][0]["logprobs"] = shapes.chat_logprobs(
                chunk.token_ids, chunk.logprobs, decode, chunk.top_logprobs
            )
        yield shapes.sse(out)
    turn = (await task)[0]
    content, calls = message(turn)
    delta = {}
    if content and content.startswith(sent) and len(content) > len(sent):
        delta["content"] = content[len(sent) :]
    if calls:
        delta["tool_calls"] = [{"index": i, **c.as_openai()} for i, c in enumerate(calls)]
    extra = {"prompt_token_ids": turn.prompt_ids, "prorsa": shapes.prorsa_fields(turn)}
    yield shapes.sse(frame(delta, extra, "tool_calls" if calls else turn.finish_reason))
    if include_usage:
        usage = shapes.usage([turn])
        yield shapes.sse(
            {
                "id": "chatcmpl-stream",
                "object": "chat.completion.chunk",
                "model": model,
                "choices": [],
                "usage": usage,
            }
        )
    yield shapes.sse("[DONE]")


async def completion_events(
    queue: asyncio.Queue,
    task: asyncio.Task,
    *,
    model: str,
    hold_text: bool,
    logprobs: bool,
    decode: Decode,
) -> AsyncIterator[bytes]:
    def frame(text: str, extra: dict, finish: str | None = None) -> dict:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None, **extra}
        return {"id": "cmpl-stream", "object": "text_completion", "model": model, "choices": [choice]}

    ids: list[int] = []
    sent = ""
    async for chunk in drain(queue, task):
        ids += chunk.token_ids
        new = "" if hold_text else _new_text(ids, sent, decode)
        sent += new
        out = frame(new, _ids(chunk))
        if logprobs:
            out["choices"][0]["logprobs"] = shapes.completion_logprobs(
                chunk.token_ids, chunk.logprobs, decode, chunk.top_logprobs
            )
        yield shapes.sse(out)
    turn = (await task)[0]
    text = turn.text or ""
    rest = text[len(sent) :] if text.startswith(sent) else ""
    extra = {"prompt_token_ids": turn.prompt_ids, "prorsa": shapes.prorsa_fields(turn)}
    yield shapes.sse(frame(rest, extra, turn.finish_reason))
    yield shapes.sse("[DONE]")


async def generate_events(
    queue: asyncio.Queue, task: asyncio.Task, *, hold_text: bool, logprobs: bool, decode: Decode
) -> AsyncIterator[bytes]:
    """SGLang's streamed `/generate` (see the module doc): `data: {text, output_ids, meta_info}` per engine chunk,
    cumulative, then the whole answer, then `data: [DONE]`."""
    ids: list[int] = []
    versions: list[int] = []
    lps: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    text = ""
    async for chunk in drain(queue, task):
        ids += chunk.token_ids
        versions += [chunk.policy_version] * len(chunk.token_ids)
        lps += chunk.logprobs or []
        tops += chunk.top_logprobs or []
        if not hold_text and decode is not None and not (decoded := decode(ids)).endswith("\ufffd"):
            text = decoded
        meta: dict[str, Any] = {
            "id": chunk.request_id,
            "finish_reason": None,
            "completion_tokens": len(ids),
            "output_token_versions": list(versions),
        }
        if logprobs and len(lps) == len(ids):
            meta["output_token_logprobs"] = [[lp, i, None] for lp, i in zip(lps, ids, strict=True)]
            if len(tops) == len(ids):
                meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in alts] for alts in tops]
        yield shapes.sse({"text": text, "output_ids": list(ids), "meta_info": meta})
    turn = (await task)[0]
    yield shapes.sse(shapes.generate_response(turn, logprobs))
    yield shapes.sse("[DONE]")


def _ids(chunk: Any) -> dict:
    """A streamed chunk's ids and the policy version of each (a chunk never spans two versions)."""
    return {
        "token_ids": list(chunk.token_ids),
        "token_versions": [chunk.policy_version] * len(chunk.token_ids),
    }

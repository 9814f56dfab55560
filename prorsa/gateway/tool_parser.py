"""Model output -> OpenAI `tool_calls`: Hermes/Qwen-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.

Pure. As vLLM's `hermes` parser does: the text before the first `<tool_call>` is the message's content, each block
is one call; output with no block, or with a block that is not a JSON object with a string `name`, is returned
whole as content and no call (a model that botches a call gets its text back, never a 500).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
PARSERS = ("hermes",)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of one output; content None when only calls were said."""
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for block in _BLOCK.findall(text):
        try:
            obj = json.loads(block.strip())
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", {})
        calls.append(
            ToolCall(
                f"call_{uuid.uuid4().hex[:24]}",
                obj["name"],
                args if isinstance(args, str) else json.dumps(args),
            )
        )
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls


Parse = Callable[
    [str, list[dict]], tuple[str | None, list[ToolCall]]
]  # (output text, tools) -> (content, calls)


def make_parser(name: str, tokenizer: Any | None) -> Parse:
    """The parser called `name`: "hermes" is this module's; any other name is one of vLLM's tool parsers
    (`vllm.tool_parsers.ToolParserManager`, e.g. "qwen3_coder", "llama3_json", "mistral"; "vllm:hermes" for vLLM's
    own hermes), used where vLLM is installed rather than written again. Raises ValueError for a name neither
    knows (or vLLM's without vLLM)."""
    if name == "hermes":
        return lambda text, tools: parse_hermes(text)
    name = name.removeprefix("vllm:")
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager
    except ImportError as exc:
        raise ValueError(f"tool parser {name!r}: only {PARSERS} without vLLM installed") from exc
    try:
        cls = ToolParserManager.get_tool_parser(name)
    except KeyError as exc:
        raise ValueError(f"unknown tool parser {name!r}") from exc
    if tokenizer is None:
        raise ValueError(f"tool parser {name!r} needs the model's tokenizer (--tokenizer)")
    try:  # vLLM's parsers check the tokenizer holds their markers: at start-up, not on a request
        cls(tokenizer)
    except RuntimeError as exc:
        raise ValueError(f"tool parser {name!r} does not fit this tokenizer: {exc}") from exc

    def parse(text: str, tools: list[dict]) -> tuple[str | None, list[ToolCall]]:
        request = ChatCompletionRequest(
            model="prorsa", messages=[{"role": "user", "content": ""}], tools=tools
        )
        info = cls(tokenizer).extract_tool_calls(text, request)  # a parser keeps per-request state: one each
        if not info.tools_called:
            return text, []
        calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in info.tool_calls]
        return info.content, calls

    return parse

"""Model output -> OpenAI `tool_calls`: Hermes/Qwen-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.

Pure. As vLLM's `hermes` parser does: the text before the first `<tool_call>` is the message's content, each block
is one call; output with no block, or with a block that is not a JSON object with a string `name`, is returned
whole as content and no call (a model that botches a call gets its text back, never a 500).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

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

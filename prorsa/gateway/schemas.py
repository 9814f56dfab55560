"""Request bodies of the gateway's endpoints, as pydantic models following the OpenAI (and SGLang) schema.

Unknown top-level fields are refused (`extra="forbid"`: a 400 naming the field), so nothing a client asks for is
silently dropped; the fields of `sampling.py`'s refusal table (min_p, logit_bias, guided decoding, ...) are accepted
here only to be refused there with a reason. Session fields (`trajectory_id`, `task`, `policy_version`) are
Prorsa's additions, sent by an OpenAI client through `extra_body`. Messages accept the extra fields an OpenAI client echoes back from a response (`refusal`,
`annotations`, ...) and keep only what the chat template reads (`template_message`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 64
# A trajectory id names NATS subjects and request ids (`<traj_id>:<turn>`): letters, digits, '_' and '-'.
TRAJECTORY_ID_PATTERN = r"^[A-Za-z0-9_\-]{1,180}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Session(_Strict):
    trajectory_id: str | None = Field(None, pattern=TRAJECTORY_ID_PATTERN)
    task: str = ""
    policy_version: int = Field(0, ge=0, le=2**53 - 1)


class _Sampling(_Strict):
    """Sampling fields both OpenAI endpoints share (see `sampling.build_sampling`)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    return_token_ids: bool | None = None  # vLLM's flag; ids are always returned (RL needs them)
    logprobs_mode: str | None = None  # "raw_logprobs" | "processed_logprobs" (sampling.py's module doc)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra field
    min_tokens: int | None = None  # vLLM's extra field
    # Refused unless neutral (sampling._NEUTRAL): accepted here so the refusal names the reason.
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    guided_json: Any = None
    guided_regex: str | None = None


class CompletionRequest(_Sampling, _Session):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI: k alternatives per token as well; 0 returns the sampled token's only
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def template_message(self) -> dict:
        """What the chat template reads: text parts joined, None fields left out."""
        content = self.content
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if p.get("type", "text") == "text")
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content or "",
        }
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "type": c.get("type", "function"),
                    "function": c.get("function", {}),
                    **({"id": c["id"]} if "id" in c else {}),
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatRequest(_Sampling, _Session):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # k alternatives per token (with logprobs)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class GenerateRequest(_Session):
    """SGLang's `/generate`: token ids (or text) in, token ids out."""

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_logprob: bool = False
    # k alternatives per token (`meta_info.output_top_logprobs`, with return_logprob)
    top_logprobs_num: int = 0
    stream: bool = False
    rid: str | None = None


class FinishRequest(_Strict):
    reward: float | None = None
    status: Literal["finished", "aborted"] = "finished"


# SGLang sampling_params names -> the OpenAI names `sampling.build_sampling` reads.
SGLANG_SAMPLING = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "seed": "seed",
    "sampling_seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "n": "n",
    "skip_special_tokens": None,  # decoding options: honoured (text is decoded without special tokens)
    "spaces_between_special_tokens": None,
    "no_stop_trim": None,
}

"""The model's chat template, applied incrementally so a session's prompts extend each other token for token.

Turn 1's prompt is the template applied to the messages (`first_prompt`). Turn k+1's prompt is turn k's prompt +
turn k's output ids + the ids of the messages that are new since (`continuation`). Re-templating the whole history
instead drifts on real templates (Qwen3 strips earlier `<think>` blocks; a re-tokenised output need not give the
sampled ids back), which silently loses the engine's prefix cache and the token-exactness RL needs.

How the new messages' ids are found, without depending on one model's template: render a short reference
conversation that ends with an assistant turn (`[user "x", assistant "y"]`, with the same `tools`), then the same
conversation + the new messages + the generation prompt. The second must extend the first token for token (else
TemplateError: the template rewrites history, and the session cannot be incremental). The new ids are what follows
the reference's last end-of-turn token (the tokenizer's eos, `<|im_end|>` on ChatML): the separator the template
puts after an assistant turn ("\\n" on ChatML), the new messages, and the generation prompt. When turn k's output
did not end with the end-of-turn token (cut by max_tokens or a stop string), that token is put first, as the
template would have closed the turn.
"""

from __future__ import annotations

from typing import Any

_REFERENCE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class TemplateError(ValueError):
    """The tokenizer has no chat template, or its template cannot be applied incrementally to these messages."""


class ChatTokenizer:
    """A Hugging Face tokenizer loaded from a local directory, with the incremental template of the module doc."""

    def __init__(self, tokenizer: Any, name: str = "") -> None:
        self.tok = tokenizer
        self.name = name
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(f"tokenizer {name!r} has no chat_template")
        eot = tokenizer.eos_token_id
        if eot is None:
            raise TemplateError(f"tokenizer {name!r} has no eos token to end a turn with")
        self.eot_id: int = int(eot)
        self.vocab_size: int = len(tokenizer)

    @classmethod
    def load(cls, path: str) -> ChatTokenizer:
        """Load from a local directory (no hub). Raises OSError when it holds no tokenizer, TemplateError when the
        tokenizer has no chat template."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path, local_files_only=True), name=path)

    # --- text <-> ids -----------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary (a simulated engine samples from a larger one) render as
        nothing, their ids still returned exactly."""
        known = [i for i in ids if 0 <= i < self.vocab_size]
        return str(self.tok.decode(known, skip_special_tokens=skip_special))

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
        """The template applied to `messages`, as ids. Raises TemplateError when the template fails on them."""
        try:
            text = self.tok.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
            )
        except Exception as exc:  # jinja raises many kinds (TemplateError, TypeError, ...) on odd messages
            raise TemplateError(f"the chat template failed on these messages: {exc}") from exc
        return self.encode(str(text))

    # --- the incremental template ---------------------------------------------------------------------------
    def first_prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        return self.render(messages, tools, generation_prompt=True)

    def continuation(
        self, previous_output: list[int], new_messages: list[dict], tools: list[dict] | None
    ) -> list[int]:
        """The ids that follow turn k's prompt + `previous_output` (see the module doc). Raises TemplateError."""
        reference = self.render(_REFERENCE, tools, generation_prompt=False)
        extended = self.render([*_REFERENCE, *new_messages], tools, generation_prompt=True)
        if extended[: len(reference)] != reference:
            raise TemplateError(
                "the chat template rewrites earlier turns: it cannot be applied incrementally"
            )
        try:
            end = len(reference) - 1 - reference[::-1].index(self.eot_id)
        except ValueError as exc:
            raise TemplateError(
                "the chat template does not end an assistant turn with the eos token"
            ) from exc
        closing = [] if previous_output and previous_output[-1] == self.eot_id else [self.eot_id]
        return closing + extended[end + 1 :]

"""A word-level tokenizer with a chat template, built in memory: what verl's and AReaL's rollout code needs of a
tokenizer (encode, decode, apply_chat_template, eos/pad ids), with no model hub.

Its vocabulary is the simulated engines' (151,936 ids: `QWEN3_VOCAB_SIZE`), so every id a simulated engine emits
decodes to a word ("t123") that encodes back to the same id, and a rendered conversation re-tokenizes exactly.
"""

from __future__ import annotations

from typing import Any

SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
ROLES = ["system", "user", "assistant", "tool"]
VOCAB_SIZE = 151_936

# Qwen-like: one `<|im_start|>role ... <|im_end|>` block per message; tools and tool calls render as plain text.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def build_tokenizer() -> Any:
    """A transformers PreTrainedTokenizerFast over a WordLevel model (Whitespace pre-tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + ROLES
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"t{i}": i for i in range(len(words), VOCAB_SIZE)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        bos_token=None,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok

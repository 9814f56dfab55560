"""A small byte-level BPE tokenizer with a ChatML chat template, trained here (no model hub on our machines).

`prorsa tiny-model DIR` writes it beside the tiny Qwen2, and `prorsa up` writes one for its gateway when no
`--tokenizer` is given, so the OpenAI chat endpoint works out of the box on simulated engines and on real vLLM
with the tiny model. It is trained with the `tokenizers` library on a fixed corpus generated from a seed (so the
same seed gives the same vocabulary on every machine and version), then saved in the Hugging Face layout
(`tokenizer.json`, `tokenizer_config.json` with `chat_template`, `special_tokens_map.json`) that
`transformers.AutoTokenizer.from_pretrained(DIR)` loads.

Special tokens come first and match the tiny Qwen2's config: id 0 `<|endoftext|>` (pad), 1 `<|im_start|>` (its
bos id), 2 `<|im_end|>` (its eos id, the end of every turn), then `<tool_call>`, `</tool_call>`, `<tool_response>`,
`</tool_response>`, `<think>`, `</think>`. The vocabulary is the model's 32000 (`vocab_size`): the corpus holds
enough made-up words for the trainer to reach it (a few seconds), so every id the tiny model samples has text. Ids
outside a tokenizer (a simulated engine samples from Qwen3's 151936) render as no text, their ids still returned.

The chat template is Qwen2.5's ChatML with Hermes-style tools: `tools` are listed in the system turn, an assistant's
`tool_calls` are rendered as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, and consecutive `tool`
messages are grouped into one user turn of `<tool_response>` blocks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# Qwen2.5-style ChatML with Hermes tool calls (what the gateway's `hermes` parser reads back).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "{% if message.content or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ fn.name }}", "arguments": '
    "{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (  # noqa: SIM905 - a word list reads better as text
    "the a an of to in and or is are was be run file test bash ls cat grep python error line code function "
    "return value list dict string int float true false none import def class self for while if else try "
    "except with open read write print path dir src tests repo git diff patch commit user assistant system "
    "tool call result output input json name arguments command query search find answer think step solve "
    "math number sum product equal prove let x y z n k i j 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } : ; , . "
    "hello world please thanks okay done fix bug issue build install make pytest assert expected got"
).split()


def _corpus(seed: int, lines: int = 6000, made_up: int = 40_000) -> list[str]:
    """Deterministic pseudo-text: chat-like lines of code and prose words, JSON tool calls, and lines of made-up
    words (syllables) that give the trainer enough distinct pieces to reach a model-sized vocabulary."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + list("aeiou")
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(made_up)]
    out = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(made_up)]
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 24))]
        line = " ".join(words)
        if i % 7 == 0:
            line = json.dumps({"name": rng.choice(_WORDS), "arguments": {"command": line}})
        elif i % 5 == 0:
            line = "    " + line.replace(" ", "_", 2) + "()"
        out.append(line)
    return out


def build_tiny_tokenizer(path: str, seed: int = 0, vocab_size: int = 32000) -> str:
    """Train and save the tokenizer (see the module doc) into `path` (created); return `path`.

    Raises ImportError when the `tokenizers` library is missing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    # Tool and think markers are ordinary added tokens, as in Qwen's tokenizer: decoding keeps them (a tool-call
    # parser reads them), while the ChatML markers are special and skipped.
    spec = json.loads((out / "tokenizer.json").read_text())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] in SPECIAL_TOKENS[:3]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    specials = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=1) + "\n")
    return str(out)

"""A randomly initialised tiny Qwen2 checkpoint that a real vLLM engine can load with no hub access.

Nothing can be downloaded from a model hub on the project's machines, so tests and CPU smoke runs of the
vLLM backend build their own model: a Qwen2 architecture (hidden 256, 4 layers, 4 query heads, 2 KV heads,
vocab 32000) with random weights, saved as `config.json` + `model.safetensors` and no tokenizer (the
backend runs with `skip_tokenizer_init=True`, token ids in and out). The output is noise, but every code
path of a real engine runs: scheduling, paged KV, prefix caching and KV transfer between engines.

Initialisation: weights drawn with std 0.1 (transformers' default is 0.02). At 0.02 the logits of this tiny
model are nearly flat (top-2 gap ~0.1) and greedy decoding repeats one token forever, so a test comparing two
generations could not tell a correct KV handoff from a broken one; at 0.1 greedy output varies from token to
token and the top-2 gap is ~1, far above the numeric noise between two engines computing the same prompt along
different paths (prefill in one batch vs. KV pulled from another engine and the last token recomputed).
The weights are saved in float32 by default so that such comparisons are tight; vLLM's CPU build downcasts a
float32 checkpoint to bfloat16 unless the engine is given dtype="float32".
"""

from __future__ import annotations

from pathlib import Path

# Shape of the tiny model; the KV footprint is 4 layers x 2 KV heads x (64 + 64) x 4 bytes = 4 KiB/token.
TINY_QWEN2_SHAPE: dict[str, int] = {
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}


def build_tiny_qwen2(path: str, seed: int = 0, dtype: str = "float32") -> str:
    """Write a random tiny Qwen2 checkpoint (config + safetensors, no tokenizer) to `path`; return `path`.

    The same `seed` gives the same weights, so two engines (or two test runs) load the same model.
    `dtype` is a torch dtype name ("float32", "bfloat16") used both for the tensors and in the config.
    Raises ImportError when torch or transformers are missing (they come with vLLM).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch_dtype = getattr(torch, dtype)
    config = Qwen2Config(
        **TINY_QWEN2_SHAPE,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.1,
        tie_word_embeddings=True,
        # No tokenizer is shipped; these ids only need to lie inside the vocabulary.
        bos_token_id=1,
        eos_token_id=2,
    )
    config.dtype = dtype
    # A private generator keeps the caller's global torch RNG untouched.
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch_dtype).eval()
    finally:
        torch.random.set_rng_state(generator_state)
    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)

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
from typing import Any

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


# The MoE variant (`build_tiny_qwen3_moe`): Qwen3-MoE's architecture at the dense model's size, 8 routed experts
# of which each token takes 2, so vLLM's fused-MoE path (and expert parallelism, where the platform has it) runs.
TINY_QWEN3_MOE_SHAPE: dict[str, int] = {
    **TINY_QWEN2_SHAPE,
    "head_dim": 64,
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}

ARCHITECTURES = ("qwen2", "qwen3-moe")


def build_tiny_model(
    path: str,
    seed: int = 0,
    dtype: str = "float32",
    arch: str = "qwen2",
    max_position_embeddings: int | None = None,
) -> str:
    """`build_tiny_qwen2` or `build_tiny_qwen3_moe` by `arch`. Raises ValueError on an unknown one."""
    if arch == "qwen2":
        return build_tiny_qwen2(path, seed, dtype, max_position_embeddings)
    if arch == "qwen3-moe":
        return build_tiny_qwen3_moe(path, seed, dtype, max_position_embeddings)
    raise ValueError(f"unknown tiny-model architecture {arch!r} (known: {', '.join(ARCHITECTURES)})")


def build_tiny_qwen3_moe(
    path: str, seed: int = 0, dtype: str = "float32", max_position_embeddings: int | None = None
) -> str:
    """Write a random tiny Qwen3-MoE checkpoint to `path` (as `build_tiny_qwen2`, with `TINY_QWEN3_MOE_SHAPE`)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(TINY_QWEN3_MOE_SHAPE)
    if max_position_embeddings is not None:
        shape["max_position_embeddings"] = max_position_embeddings
    config = Qwen3MoeConfig(
        **shape,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=True,
        norm_topk_prob=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _save(Qwen3MoeForCausalLM, config, path, seed, dtype)


def build_tiny_qwen2(
    path: str,
    seed: int = 0,
    dtype: str = "float32",
    max_position_embeddings: int | None = None,
    shape: dict[str, int] | None = None,
) -> str:
    """Write a random tiny Qwen2 checkpoint (config + safetensors, no tokenizer) to `path`; return `path`.

    The same `seed` gives the same weights, so two engines (or two test runs) load the same model.
    `dtype` is a torch dtype name ("float32", "bfloat16") used both for the tensors and in the config.
    `max_position_embeddings`: the longest context the model claims (default 4,096; vLLM refuses a longer
    `max_model_len`). `shape`: fields of `TINY_QWEN2_SHAPE` to override (a larger checkpoint for the weight-update
    benchmark). Raises ImportError when torch or transformers are missing (they come with vLLM).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = {**TINY_QWEN2_SHAPE, **(shape or {})}
    if max_position_embeddings is not None:
        fields["max_position_embeddings"] = max_position_embeddings
    config = Qwen2Config(
        **fields,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.1,
        tie_word_embeddings=True,
        # No tokenizer is shipped; these ids only need to lie inside the vocabulary.
        bos_token_id=1,
        eos_token_id=2,
    )
    return _save(Qwen2ForCausalLM, config, path, seed, dtype)


def _save(model_cls: Any, config: Any, path: str, seed: int, dtype: str) -> str:
    import torch

    torch_dtype = getattr(torch, dtype)
    config.dtype = dtype
    # A private generator keeps the caller's global torch RNG untouched.
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_cls(config).to(torch_dtype).eval()
    finally:
        torch.random.set_rng_state(generator_state)
    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)

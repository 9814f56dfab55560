"""`prorsa tiny-model DIR`: write the small random Qwen2 checkpoint the vLLM tests use, for `--model DIR`.

A machine with no model hub has no model for the README's real-vLLM commands (`prorsa rollout --backend vllm`,
`prorsa demo --backend vllm`, `prorsa profile`). This writes the same checkpoint the vLLM tests build
(`services.engine_agent.tiny_model.build_tiny_qwen2`: hidden 256, 4 layers, vocab 32000, random weights; the
engines run token ids in and out), in a few seconds on a CPU, and beside it a small tokenizer with a ChatML chat
template trained here (`prorsa.gateway.tiny_tokenizer`), so the gateway of `prorsa up --model DIR` serves chat on
it. Its output is noise, but every path of a real engine runs. Needs torch and transformers, which come with vLLM
(`make vllm`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="directory to write config.json + model.safetensors into (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="weights seed: the same seed gives the same model")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="weight dtype (float32 keeps comparisons between engines tight; run engines with --dtype float32)",
    )
    p.add_argument(
        "--arch",
        default="qwen2",
        choices=("qwen2", "qwen3-moe"),
        help="qwen2 (dense) or qwen3-moe (8 routed experts, 2 per token: vLLM's MoE path) (default: qwen2)",
    )
    p.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="longest context the model claims; vLLM refuses a longer max_model_len (default: 4096)",
    )
    p.add_argument("--force", action="store_true", help="overwrite a directory that already holds a model")


def run(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        print(f"prorsa tiny-model: {out} exists and is not a directory", file=sys.stderr)
        return 2
    if (out / "config.json").exists() and not args.force:
        print(
            f"prorsa tiny-model: {out} already holds a model (config.json); --force overwrites it",
            file=sys.stderr,
        )
        return 2
    try:
        import torch  # noqa: F401  (only to tell a missing dependency from our own errors)
        import transformers  # noqa: F401
    except ImportError as exc:
        print(
            f"prorsa tiny-model: needs torch and transformers ({exc.name} is missing); they come with vLLM: "
            "`make vllm`, or pip install torch transformers",
            file=sys.stderr,
        )
        return 2
    from prorsa.gateway.tiny_tokenizer import build_tiny_tokenizer
    from services.engine_agent.tiny_model import build_tiny_model

    path = build_tiny_model(
        str(out),
        seed=args.seed,
        dtype=args.dtype,
        arch=args.arch,
        max_position_embeddings=args.max_position_embeddings,
    )
    build_tiny_tokenizer(path, seed=args.seed)
    print(f"tiny {args.arch} (seed {args.seed}, {args.dtype}) and its chat tokenizer written to {path}")
    print(f"use it as: prorsa rollout --backend vllm --model {path} --dtype {args.dtype} ...")
    return 0

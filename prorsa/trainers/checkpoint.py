"""Write new policy weights as a model directory every engine can load, atomically.

A real engine reloads weights from a Hugging Face model directory (config.json + safetensors + tokenizer); Prorsa
engines accept only a directory under their weights root (`--weights-root`, PRORSA_WEIGHTS_ROOT). So a trainer
writes the trained tensors as `model.safetensors` beside a copy of the base model's other files (config,
tokenizer, generation config), into a temporary directory next to the target that is renamed into place when
complete: an engine that lists the root never sees half a checkpoint, and a crash leaves only a `.tmp-` directory.

torch and safetensors are imported when called: only a trainer's process writes weights.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# Files of a model directory that hold weights: replaced by the new tensors, never copied from the base.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def save_checkpoint(
    weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
    out_dir: str | os.PathLike[str],
    base_model_dir: str,
) -> Path:
    """Write `weights` (a state dict, or verl's generator of (name, tensor)) to `out_dir` as `model.safetensors`,
    with the non-weight files of `base_model_dir`. Returns `out_dir`. An `out_dir` that already exists is left as
    it is (a second replica, or a retry, of the same version). Raises FileNotFoundError without a config.json in
    `base_model_dir`, ValueError when `weights` is empty."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists():
        return out
    base = Path(base_model_dir)
    if not (base / "config.json").is_file():
        raise FileNotFoundError(
            f"{base}: no config.json (the base model directory the checkpoint's files come from)"
        )
    items = weights.items() if isinstance(weights, Mapping) else weights
    # safetensors wants contiguous CPU tensors that share no storage (tied embeddings are saved once per name).
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in items}
    if not tensors:
        raise ValueError("no weights to save")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for item in base.iterdir():
            if (
                item.is_file()
                and not item.name.endswith(_WEIGHT_SUFFIXES)
                and item.name not in _WEIGHT_INDEXES
            ):
                shutil.copy2(item, tmp / item.name)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # Readable by engines running as another user, as the copied files are (safetensors writes 0600).
        os.chmod(tmp / "model.safetensors", 0o644)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

"""`prorsa tiny-model DIR` writes the vLLM tests' checkpoint (one builder, `build_tiny_qwen2`, for both), the same
seed giving the same weights, and refuses plainly to overwrite a model or write over a file."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from prorsa.cli import main

pytest.importorskip("torch", reason="torch is not installed (it comes with vLLM: make vllm)")
pytest.importorskip("transformers", reason="transformers is not installed (it comes with vLLM: make vllm)")

from services.engine_agent.tiny_model import TINY_QWEN2_SHAPE, build_tiny_qwen2  # noqa: E402


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_model_writes_the_test_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny"
    assert main(["tiny-model", str(out), "--seed", "3"]) == 0
    assert f"written to {out}" in capsys.readouterr().out
    # ... with a chat tokenizer the gateway serves it with (ChatML: eos = the model's eos id 2)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] and tokenizer_config["eos_token"] == "<|im_end|>"
    assert (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert {k: config[k] for k in TINY_QWEN2_SHAPE} == TINY_QWEN2_SHAPE
    # The very checkpoint the vLLM tests' fixture builds: same builder, same seed, same bytes.
    assert _digest(out) == _digest(Path(build_tiny_qwen2(str(tmp_path / "fixture"), seed=3)))
    assert _digest(out) != _digest(Path(build_tiny_qwen2(str(tmp_path / "other"), seed=4)))


def test_tiny_model_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "config.json").write_text("{}")
    run = [sys.executable, "-m", "prorsa", "tiny-model", str(out)]
    refused = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "already holds a model" in refused.stderr
    assert (out / "config.json").read_text() == "{}"
    afile = tmp_path / "a-file"
    afile.write_text("x")
    not_dir = subprocess.run([*run[:-1], str(afile)], capture_output=True, text=True, timeout=120)
    assert not_dir.returncode == 2 and "not a directory" in not_dir.stderr

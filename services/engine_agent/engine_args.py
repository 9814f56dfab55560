"""vLLM's own engine arguments as a user gives them (`--engine-arg K=V`, `--engine-args-file F`), and what the same
arguments mean to a simulated engine (pure: no vLLM import, no I/O but reading the file).

Keys are `AsyncEngineArgs` field names; dashes are accepted for underscores (`max-model-len`), as on vLLM's own
command line. A value is read as JSON when it parses (`4096`, `true`, `0.9`, `{"backends": ["UCX"]}`), else it
stays a string (`bfloat16`). Precedence, lowest first: Prorsa's platform defaults (`backends/vllm_launch.prorsa_defaults`),
the file, then each `--engine-arg` in order — the user always wins. A file is either one JSON object or one `K=V`
per line (blank lines and `#` comments skipped).

Simulated engines honour the arguments that have a meaning in the performance model (`sim_overrides`):
`max_model_len` (context + output per sequence), `max_num_seqs` (sequences per batch, per data-parallel rank as in
vLLM: the engine's batch is that times its ranks) and `max_num_batched_tokens` (tokens per step per rank: the
mixed role's chunk budget, and a prefill step's budget over all ranks). Every other key is vLLM's alone and is
ignored there (listed by `sim_ignored`, which the engine logs).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# Engine arguments a simulated engine honours (see the module docstring).
SIM_KEYS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens")


class EngineArgError(ValueError):
    """An engine argument the user wrote cannot be read (names the argument and why)."""


def normalise_key(key: str) -> str:
    """`max-model-len` and `max_model_len` name the same argument. Raises EngineArgError on an empty or odd key."""
    name = key.strip().replace("-", "_")
    if not name or not name.replace("_", "").isalnum() or name[0].isdigit():
        raise EngineArgError(f"engine argument name {key!r} is not an AsyncEngineArgs field name")
    return name


def parse_value(text: str) -> Any:
    """JSON when it parses (numbers, booleans, null, lists, objects), else the text as a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_engine_arg(item: str) -> tuple[str, Any]:
    """One `K=V`. Raises EngineArgError when there is no `=` or the key is not a field name."""
    key, sep, value = item.partition("=")
    if not sep:
        raise EngineArgError(f"engine argument {item!r} is not KEY=VALUE")
    return normalise_key(key), parse_value(value.strip())


def parse_engine_args(items: Iterable[str]) -> dict[str, Any]:
    """`--engine-arg` values in order (a later one overrides an earlier one). Raises EngineArgError."""
    out: dict[str, Any] = {}
    for item in items:
        key, value = parse_engine_arg(item)
        out[key] = value
    return out


def parse_engine_args_text(text: str, source: str = "engine args file") -> dict[str, Any]:
    """A file's text: one JSON object, or `K=V` lines. Raises EngineArgError naming `source` and the line."""
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise EngineArgError(f"{source}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise EngineArgError(f"{source}: a JSON file must hold one object of engine arguments")
        return {normalise_key(str(k)): v for k, v in data.items()}
    out: dict[str, Any] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            key, value = parse_engine_arg(line)
        except EngineArgError as exc:
            raise EngineArgError(f"{source}, line {n}: {exc}") from None
        out[key] = value
    return out


def load_engine_args(file: str | None, items: Iterable[str]) -> dict[str, Any]:
    """The file's arguments (if any), then `items` over them. Raises EngineArgError (also for an unreadable
    file)."""
    out: dict[str, Any] = {}
    if file:
        try:
            text = Path(file).read_text()
        except OSError as exc:
            raise EngineArgError(f"cannot read engine args file {file}: {exc.strerror}") from None
        out.update(parse_engine_args_text(text, file))
    out.update(parse_engine_args(items))
    return out


def merge_engine_args(defaults: Mapping[str, Any], user: Mapping[str, Any]) -> dict[str, Any]:
    """`defaults` with `user` over them. Dict-valued arguments present in both (`kv_transfer_config`,
    `compilation_config`, ...) merge one level deep, the user's keys winning, so a user can add
    `kv_connector_extra_config={"backends": ["UCX"]}` without restating what Prorsa's connector needs."""
    out = dict(defaults)
    for key, value in user.items():
        base = out.get(key)
        if isinstance(base, Mapping) and isinstance(value, Mapping):
            merged = dict(base)
            for k, v in value.items():
                if isinstance(merged.get(k), Mapping) and isinstance(v, Mapping):
                    merged[k] = {**merged[k], **v}
                else:
                    merged[k] = v
            out[key] = merged
        else:
            out[key] = value
    return out


def parallel_sizes(args: Mapping[str, Any]) -> tuple[int, int, int]:
    """(tensor, pipeline, data) parallel sizes the arguments ask for (1 where not given). Raises EngineArgError
    on a size that is not a positive integer."""
    sizes = []
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        value = args.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EngineArgError(f"{key} must be a positive integer, got {value!r}")
        sizes.append(value)
    return sizes[0], sizes[1], sizes[2]


def _positive_int(args: Mapping[str, Any], key: str) -> int | None:
    value = args.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineArgError(f"{key} must be a positive integer, got {value!r}")
    return value


def sim_overrides(args: Mapping[str, Any], dp_ranks: int) -> tuple[int | None, dict[str, int]]:
    """What `args` change on a simulated engine whose profile has `dp_ranks` ranks: (max_model_len or None,
    profile fields to replace). Raises EngineArgError on a value that is not a positive integer."""
    max_model_len = _positive_int(args, "max_model_len")
    fields: dict[str, int] = {}
    seqs = _positive_int(args, "max_num_seqs")
    if seqs is not None:
        fields["max_batch"] = seqs * dp_ranks
    step_tokens = _positive_int(args, "max_num_batched_tokens")
    if step_tokens is not None:
        fields["mixed_chunk_tokens"] = step_tokens
        fields["prefill_batch_tokens"] = step_tokens * dp_ranks
    return max_model_len, fields


def sim_ignored(args: Mapping[str, Any]) -> list[str]:
    """The arguments a simulated engine has no meaning for (sorted), so the engine can say so once."""
    return sorted(k for k in args if k not in SIM_KEYS)

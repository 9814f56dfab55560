"""How one vLLM engine is launched: its configuration, Prorsa's platform-fitted engine arguments under the user's,
and the environment its engine-core process starts in (the launch configuration; `vllm_engine.VllmEngine` runs it).

Pure but for `_engine_args`, which imports vLLM to build `AsyncEngineArgs` (docs/gpu.md, "Engine arguments").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.engine_agent.backend import BackendError
from services.engine_agent.engine_args import merge_engine_args, parallel_sizes


@dataclass(frozen=True, slots=True)
class VllmEngineConfig:
    """How to build one engine. `replace()` it and `restart()` to change anything (vLLM has no live reconfig).

    Fields left None take a default fitted to the platform (`prorsa_defaults`); `extra_engine_args` (vLLM's own
    `AsyncEngineArgs`, from `--engine-arg`/`--engine-args-file`) win over everything Prorsa sets."""

    model_path: str
    engine_id: str  # NIXL engine id: unique among engines that exchange KV
    # This engine's NIXL side channel (decode engines handshake here); data-parallel rank r listens on
    # nixl_port + r (vLLM's rule), so ports nixl_port .. nixl_port + dp - 1 must be free on the host.
    nixl_port: int = 5600
    nixl_host: str = (
        "127.0.0.1"  # address decode engines reach the side channel on (goes into kv_transfer_params)
    )
    kv_transfer: bool = True  # attach the NIXL connector (kv_both); False: a plain colocated engine
    kv_lease_s: int = 120  # how long a prefill engine keeps handed-off KV for a decode engine to claim
    # KV cache size in bytes. None: 512 MiB of host memory on CPU; on GPU vLLM profiles the memory and takes
    # `gpu_memory_utilization` of it (an engine argument).
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None  # None: 4,096 on CPU (a small machine's memory); on GPU the model's own
    max_num_seqs: int = 64  # most sequences in one batch (per data-parallel rank, as in vLLM)
    max_num_batched_tokens: int | None = None  # tokens per step (chunked prefill); None = vLLM's default
    dtype: str = "auto"  # "auto" follows the checkpoint (vLLM downcasts float32 to bfloat16 on CPU)
    seed: int = 0
    # CPU builds only: OpenMP threads of the engine process, unbound. vLLM's default binds one thread per core;
    # on a small shared machine a bound thread on a busy core stalls every parallel region (measured 5 tok/s
    # vs 60 tok/s single-sequence decode on 2 cores). None keeps vLLM's automatic binding.
    cpu_threads: int | None = 1
    extra_engine_args: Mapping[str, Any] = field(default_factory=dict)  # AsyncEngineArgs fields, over ours


@contextlib.contextmanager
def _environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or, for None, unset) environment variables for the duration of the block; restore them after."""
    saved = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


CPU_KV_CACHE_BYTES = 512 << 20  # CPU default: host memory is shared with everything else on the machine
CPU_MAX_MODEL_LEN = 4096


def prorsa_defaults(config: VllmEngineConfig, is_cpu: bool) -> dict[str, Any]:
    """What Prorsa sets on `AsyncEngineArgs` before the user's engine arguments, fitted to the platform.

    Everywhere: token ids in and out, prefix caching, stats to our logger only, the NIXL connector as `kv_both`.
    CPU only: eager mode (no torch.compile / graph capture: seconds, not minutes, to (re)start on a small
    machine), a fixed KV size and a 4,096-token model length. On GPU vLLM's own defaults stand: CUDA graphs,
    memory profiling (`gpu_memory_utilization`), the model's full length."""
    args: dict[str, Any] = {
        "model": config.model_path,
        "skip_tokenizer_init": True,  # token ids in and out; the trainer owns the tokenizer
        "enable_prefix_caching": True,
        "max_num_seqs": config.max_num_seqs,
        "dtype": config.dtype,
        "seed": config.seed,
        "disable_log_stats": True,  # stats reach our own logger only (no periodic log lines); see vllm_stats
    }
    if config.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = config.max_num_batched_tokens
    if config.kv_transfer:
        args["kv_transfer_config"] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "engine_id": config.engine_id,
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"kv_lease_duration": config.kv_lease_s},
        }
    if is_cpu:
        args["enforce_eager"] = True
        args["kv_cache_memory_bytes"] = config.kv_cache_bytes or CPU_KV_CACHE_BYTES
        args["max_model_len"] = config.max_model_len or CPU_MAX_MODEL_LEN
    else:
        if config.kv_cache_bytes is not None:
            args["kv_cache_memory_bytes"] = config.kv_cache_bytes
        if config.max_model_len is not None:
            args["max_model_len"] = config.max_model_len
    return args


def engine_kwargs(config: VllmEngineConfig, is_cpu: bool) -> dict[str, Any]:
    """Prorsa's defaults with the user's engine arguments over them (`engine_args.merge_engine_args`). Raises
    EngineArgError on a parallel size that is not a positive integer."""
    merged = merge_engine_args(prorsa_defaults(config, is_cpu), config.extra_engine_args)
    parallel_sizes(merged)  # checked here, before a minute of engine start-up
    return merged


def _engine_env(config: VllmEngineConfig, is_cpu: bool) -> dict[str, str | None]:
    env: dict[str, str | None] = {
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(config.nixl_port),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": config.nixl_host,
    }
    if not is_cpu:
        return env  # UCX_*, NCCL_* and the rest pass through from the agent's environment untouched
    # The legacy variable would override `kv_cache_bytes` on CPU builds.
    env["VLLM_CPU_KVCACHE_SPACE"] = None
    tp, pp, dp = parallel_sizes(engine_kwargs(config, is_cpu))
    if tp * pp * dp == 1 and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:
        # One worker: run the model inside the engine-core process (UniProcExecutor). On CPU builds vLLM otherwise
        # adds a worker process behind a shared-memory queue, which starts slower and competes for the cores (a
        # 16-token generation took 46 s that way vs 10 s in-process on the loaded 2-core machine). With several
        # workers (TP/PP/DP) vLLM's multiprocessing executor is required, and a user's own setting stands.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if config.cpu_threads is not None:
        env["OMP_NUM_THREADS"] = str(config.cpu_threads)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def _engine_args(config: VllmEngineConfig, is_cpu: bool) -> Any:
    """`AsyncEngineArgs` from `engine_kwargs`. Raises BackendError naming an argument vLLM does not have."""
    import dataclasses as dc

    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs = engine_kwargs(config, is_cpu)
    known = {f.name for f in dc.fields(AsyncEngineArgs)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise BackendError(
            f"engine {config.engine_id}: vLLM has no engine argument {', '.join(unknown)} "
            "(names are AsyncEngineArgs fields, e.g. max_model_len, tensor_parallel_size)"
        )
    kv = kwargs.get("kv_transfer_config")
    if isinstance(kv, Mapping):
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv)
    return AsyncEngineArgs(**kwargs)

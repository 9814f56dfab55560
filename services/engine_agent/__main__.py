"""`python -m services.engine_agent --engine-id ID --backend sim|vllm --role mixed|prefill|decode ...`

The engine id defaults to the host name (made subject-safe), so `docker compose up --scale engine=N` gives every
replica its own id. `--backend vllm` imports the vLLM backend only when chosen: the simulated path never imports vllm.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import socket
import sys
from collections.abc import Sequence

from proto import ROLES
from services.engine_agent.agent import AgentConfig, EngineAgent
from services.engine_agent.backend import Backend
from services.engine_agent.role_state import DEFAULT_MAX_EPOCH_JUMP
from services.engine_agent.weights_guard import DEFAULT_MAX_VERSION_JUMP
from services.runtime.main import run_service_main
from services.runtime.nats_server import free_port
from services.runtime.service import Service

DEFAULT_PROFILE = "qwen3-235b"


def default_engine_id() -> str:
    """The host name with anything a subject token cannot hold replaced by '-'."""
    name = re.sub(r"[^A-Za-z0-9_\-:]", "-", socket.gethostname()) or "engine"
    return name[:200]


def extend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine-id", default=None, help="engine id (default: the host name)")
    p.add_argument("--backend", choices=("sim", "vllm"), default="sim")
    p.add_argument("--role", choices=ROLES, default="mixed", help="role at start-up (default: mixed)")
    p.add_argument(
        "--profile",
        default=None,
        help="performance profile, built-in name or a JSON file from `prorsa profile`: the sim backend runs as it "
        f"(default {DEFAULT_PROFILE}); every engine reports it to the allocator (vllm: only if given)",
    )
    p.add_argument(
        "--speedup",
        type=float,
        default=None,
        help="sim: virtual seconds per wall second (default: $PRORSA_TIME_SCALE if set, else 10)",
    )
    p.add_argument("--model", default=None, help="vllm: model path")
    p.add_argument("--max-model-len", type=int, default=None, help="context + output tokens per sequence")
    p.add_argument("--kv-ttl-s", type=float, default=480.0, help="sim: virtual seconds handed-off KV is kept")
    p.add_argument(
        "--ack-wait-s",
        type=float,
        default=3.0,
        help="JetStream ack_wait of the work consumers: how soon a dead engine's work goes elsewhere",
    )
    p.add_argument("--stats-interval-s", type=float, default=1.0)
    p.add_argument(
        "--chunk-interval-s", type=float, default=0.02, help="at most one TokenChunk per request per interval"
    )
    p.add_argument(
        "--prefill-budget-tokens", type=int, default=32_768, help="prompt tokens held for prefill at most"
    )
    p.add_argument("--nixl-host", default=None, help="vllm: address decode engines reach this engine's KV on")
    p.add_argument("--nixl-port", type=int, default=0, help="vllm: KV side-channel port (0: a free port)")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="vllm: KV cache size in bytes")
    p.add_argument("--max-num-seqs", type=int, default=None, help="vllm: most sequences in one batch")
    p.add_argument(
        "--weights-root",
        default=os.environ.get("PRORSA_WEIGHTS_ROOT", ""),
        help="load announced weights only from under this directory (default: $PRORSA_WEIGHTS_ROOT; unset: "
        "only reloads from the model path)",
    )
    p.add_argument(
        "--max-epoch-jump",
        type=int,
        default=DEFAULT_MAX_EPOCH_JUMP,
        help="refuse a command epoch more than this above the newest accepted",
    )
    p.add_argument(
        "--max-version-jump",
        type=int,
        default=DEFAULT_MAX_VERSION_JUMP,
        help="refuse a policy version more than this above the newest taken",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="vllm: model dtype (default: the checkpoint's; float32 is far faster on CPUs without bf16)",
    )


def make_backend(args: argparse.Namespace, engine_id: str) -> Backend:
    """The backend named by `--backend`. Raises SystemExit with a clear message when it cannot be built."""
    if args.backend == "sim":
        from services.engine_agent.backends.sim_backend import SimBackend
        from services.engine_agent.engine_core import DEFAULT_MAX_MODEL_LEN
        from services.runtime.model_profiles import load_profile

        try:
            profile = load_profile(args.profile or DEFAULT_PROFILE)
        except ValueError as exc:
            raise SystemExit(f"engine_agent: {exc}") from None
        return SimBackend(
            profile,
            engine_id,
            role=args.role,
            speedup=args.speedup,
            max_model_len=args.max_model_len or DEFAULT_MAX_MODEL_LEN,
            kv_ttl_s=args.kv_ttl_s,
        )
    return _vllm_backend(args, engine_id)


def _vllm_backend(args: argparse.Namespace, engine_id: str) -> Backend:
    if not args.model:
        raise SystemExit("engine_agent: --backend vllm needs --model PATH")
    module = "services.engine_agent.backends.vllm_backend"
    try:
        vllm_backend = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            raise SystemExit(
                "engine_agent: the vLLM backend is not part of this build (backends/vllm_backend.py)"
            ) from None
        raise SystemExit(f"engine_agent: --backend vllm needs vLLM installed ({exc})") from None
    from services.engine_agent.backends.vllm_engine import VllmEngineConfig

    given = {
        "max_model_len": args.max_model_len,
        "nixl_host": args.nixl_host,
        "kv_cache_bytes": args.kv_cache_bytes,
        "max_num_seqs": args.max_num_seqs,
        "dtype": args.dtype,
    }
    config = VllmEngineConfig(
        model_path=args.model,
        engine_id=engine_id,
        nixl_port=args.nixl_port or free_port(),  # one side channel per engine: several may share a host
        **{k: v for k, v in given.items() if v is not None},
    )
    return vllm_backend.VllmBackend(config, role=args.role)  # type: ignore[no-any-return]


def make_agent(args: argparse.Namespace, url: str, namespace: str) -> Service:
    engine_id = args.engine_id or default_engine_id()
    config = AgentConfig(
        role=args.role,
        profile=args.profile or (DEFAULT_PROFILE if args.backend == "sim" else ""),
        ack_wait_s=args.ack_wait_s,
        stats_interval_s=args.stats_interval_s,
        chunk_interval_s=args.chunk_interval_s,
        prefill_budget_tokens=args.prefill_budget_tokens,
        max_epoch_jump=args.max_epoch_jump,
        max_version_jump=args.max_version_jump,
        weights_root=args.weights_root,
    )
    return EngineAgent(
        url,
        namespace,
        engine_id=engine_id,
        backend=make_backend(args, engine_id),
        config=config,
        instance_id=args.instance_id,
        metrics_port=args.metrics_port,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_service_main(make_agent, "Prorsa engine agent: one rollout engine", argv, extend)


def exit_process(rc: int) -> None:
    """Leave the process with `rc`; quickly if vLLM was loaded.

    By the time `main` returns, the agent has handed on its work, stopped its engine and drained its NATS
    connection. With vLLM loaded, the interpreter's own finalisation (native NIXL / ZMQ / torch objects) then took
    another ~7 s on the 2-core machine, long enough for `prorsa up`'s stop to time out and SIGKILL the agent.
    Nothing is left to flush but stdio, so skip it.
    """
    if "vllm" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    exit_process(main())

"""`python -m services.engine_agent --engine-id ID --backend sim|vllm --role mixed|prefill|decode ...`

The engine id defaults to the host name (made subject-safe), so `docker compose up --scale engine=N` gives every
replica its own id. `--backend vllm` imports the vLLM backend only when chosen: the simulated path never imports vllm.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
import socket
import sys
from collections.abc import Sequence
from typing import Any

from proto import ROLES
from services.engine_agent.agent import AgentConfig, EngineAgent
from services.engine_agent.backend import Backend, BackendError
from services.engine_agent.engine_args import (
    EngineArgError,
    load_engine_args,
    parallel_sizes,
    parse_engine_args,
    sim_ignored,
    sim_overrides,
)
from services.engine_agent.kv_host import KvHostError, choose_nixl_host, free_port_block
from services.engine_agent.role_state import DEFAULT_MAX_EPOCH_JUMP
from services.engine_agent.weights_guard import DEFAULT_MAX_VERSION_JUMP
from services.runtime.main import run_service_main
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
    p.add_argument(
        "--kv-ttl-s",
        type=float,
        default=480.0,
        help="sim: virtual seconds handed-off KV is kept (default: 480)",
    )
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
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="K=V",
        help="one of vLLM's engine arguments (an AsyncEngineArgs field, e.g. tensor_parallel_size=2, "
        "max_model_len=262144, gpu_memory_utilization=0.9), over Prorsa's defaults; repeatable; the value is read "
        "as JSON when it parses. Simulated engines honour max_model_len, max_num_seqs and max_num_batched_tokens "
        "(default: none)",
    )
    p.add_argument(
        "--engine-args-file",
        default=None,
        help="vLLM engine arguments from a file: one JSON object, or K=V lines; --engine-arg wins over it "
        "(default: none)",
    )
    p.add_argument(
        "--role-engine-arg",
        action="append",
        default=[],
        metavar="ROLE:K=V",
        help="vllm: an engine argument for one role only (prefill, decode or mixed), over --engine-arg, e.g. "
        "decode:data_parallel_size=2; a switch to a role whose arguments differ restarts the engine, between "
        "equal ones it is in place; repeatable (default: none)",
    )
    p.add_argument(
        "--nixl-host",
        default=None,
        help="vllm: address decode engines reach this engine's KV on (default: 127.0.0.1 when the NATS server "
        "is on this host, else this host's address facing it; a loopback address is refused then)",
    )
    p.add_argument(
        "--nixl-port",
        type=int,
        default=0,
        help="vllm: KV side-channel port; data-parallel rank r uses port + r (default 0: a free block of ports)",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="vllm: KV cache size in bytes (default: 512 MiB on CPU; on GPU vLLM's gpu_memory_utilization)",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="vllm: most sequences in one batch (default: 64)"
    )
    p.add_argument(
        "--start-timeout-s",
        type=float,
        default=None,
        help="give up (exit 1) when the engine has not started within this many seconds (default: no limit)",
    )
    p.add_argument(
        "--liveness-interval-s",
        type=float,
        default=2.0,
        help="how often to check that the engine still serves; a dead one makes the agent hand its work on "
        "and exit 1 (default: 2)",
    )
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


def user_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """--engine-args-file, then --engine-arg over it. Raises SystemExit naming a bad argument."""
    try:
        return load_engine_args(args.engine_args_file, args.engine_arg)
    except EngineArgError as exc:
        raise SystemExit(f"engine_agent: {exc}") from None


def role_engine_args(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """--role-engine-arg values by role. Raises SystemExit naming a bad one."""
    out: dict[str, list[str]] = {}
    for item in args.role_engine_arg:
        role, sep, rest = item.partition(":")
        if not sep or role not in ROLES:
            raise SystemExit(
                f"engine_agent: --role-engine-arg {item!r} is not ROLE:K=V (ROLE: {', '.join(ROLES)})"
            )
        out.setdefault(role, []).append(rest)
    try:
        return {role: parse_engine_args(items) for role, items in out.items()}
    except EngineArgError as exc:
        raise SystemExit(f"engine_agent: {exc}") from None


def make_backend(args: argparse.Namespace, engine_id: str, nats_url: str = "") -> Backend:
    """The backend named by `--backend`. Raises SystemExit with a clear message when it cannot be built."""
    engine_args = user_engine_args(args)
    if args.backend == "sim":
        return _sim_backend(args, engine_id, engine_args)
    return _vllm_backend(args, engine_id, engine_args, nats_url)


def _sim_backend(args: argparse.Namespace, engine_id: str, engine_args: dict[str, Any]) -> Backend:
    from services.engine_agent.backends.sim_backend import SimBackend
    from services.engine_agent.engine_core import DEFAULT_MAX_MODEL_LEN
    from services.runtime.model_profiles import load_profile

    try:
        profile = load_profile(args.profile or DEFAULT_PROFILE)
        max_model_len, fields = sim_overrides(engine_args, profile.dp_ranks)
        profile = dataclasses.replace(profile, **fields)
    except ValueError as exc:  # EngineArgError included
        raise SystemExit(f"engine_agent: {exc}") from None
    ignored = sim_ignored(engine_args)
    if args.role_engine_arg:
        print(
            "engine_agent: simulated engines ignore --role-engine-arg (one profile per engine)",
            file=sys.stderr,
        )
    if ignored:
        print(
            f"engine_agent: simulated engine ignores engine arguments {', '.join(ignored)}", file=sys.stderr
        )
    return SimBackend(
        profile,
        engine_id,
        role=args.role,
        speedup=args.speedup,
        max_model_len=max_model_len or args.max_model_len or DEFAULT_MAX_MODEL_LEN,
        kv_ttl_s=args.kv_ttl_s,
    )


def _vllm_backend(
    args: argparse.Namespace, engine_id: str, engine_args: dict[str, Any], nats_url: str
) -> Backend:
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

    per_role = role_engine_args(args)
    try:
        # The largest data-parallel size any role runs decides the block of side-channel ports.
        dp = max(parallel_sizes({**engine_args, **extra})[2] for extra in [{}, *per_role.values()])
        nixl_host = choose_nixl_host(args.nixl_host, nats_url)
        # One side channel per engine and per data-parallel rank (port + rank): several may share a host.
        nixl_port = args.nixl_port or free_port_block(dp)
    except (EngineArgError, KvHostError) as exc:
        raise SystemExit(f"engine_agent: {exc}") from None
    given = {
        "max_model_len": args.max_model_len,
        "kv_cache_bytes": args.kv_cache_bytes,
        "max_num_seqs": args.max_num_seqs,
        "dtype": args.dtype,
    }
    config = VllmEngineConfig(
        model_path=args.model,
        engine_id=engine_id,
        nixl_port=nixl_port,
        nixl_host=nixl_host,
        extra_engine_args=engine_args,
        **{k: v for k, v in given.items() if v is not None},
    )
    # Every role gets its full argument set, so a switch back to a role without arguments of its own restores
    # the engine-wide ones (VllmBackend.set_role restarts only when they differ from the running engine's).
    overrides = (
        {role: {"extra_engine_args": {**engine_args, **per_role.get(role, {})}} for role in ROLES}
        if per_role
        else {}
    )
    if per_role.get(args.role):
        config = dataclasses.replace(config, extra_engine_args={**engine_args, **per_role[args.role]})
    return vllm_backend.VllmBackend(  # type: ignore[no-any-return]
        config, role=args.role, role_overrides=overrides
    )


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
        start_timeout_s=args.start_timeout_s,
        liveness_interval_s=args.liveness_interval_s,
    )
    return EngineAgent(
        url,
        namespace,
        engine_id=engine_id,
        backend=make_backend(args, engine_id, url),
        config=config,
        instance_id=args.instance_id,
        metrics_port=args.metrics_port,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until stopped (0), or until the engine failed to start or died (1: a supervisor restarts us)."""
    try:
        return run_service_main(make_agent, "Prorsa engine agent: one rollout engine", argv, extend)
    except BackendError as exc:  # the engine could not start (or not in time): said once, without a traceback
        print(f"engine_agent: {exc}", file=sys.stderr, flush=True)
        return 1


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

"""`prorsa up`: embedded NATS (unless --nats) + every service + N engine agents in one process tree, supervised.

A child that dies is restarted (same engine id, exponential backoff; see `prorsa.supervisor`) and the cluster goes
on: every exit and restart is printed, and a crash loop is printed as such on every exit until the child runs stably.

The embedded server requires credentials (unless --no-auth): `prorsa up` writes them into a private directory and
prints its path (`credentials: DIR`), never a secret; `source DIR/trainer.env` (or `operator.env` for
`prorsa status`) to connect as that role.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import time
from collections.abc import Callable

from services.runtime.bus import namespace_from_env, nats_url_from_env
from services.runtime.bus_secrets import TlsFiles
from services.runtime.credentials import BusCredentials


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", default=None, help="use this NATS server instead of starting an embedded one")
    p.add_argument("--namespace", default=None)
    p.add_argument("--engines", type=int, default=4, help="engine agents to start")
    p.add_argument("--backend", choices=("sim", "vllm"), default="sim")
    p.add_argument("--model", default=None, help="model path for --backend vllm")
    p.add_argument(
        "--profile",
        default=None,
        help="performance profile (built-in or JSON, e.g. from `prorsa profile`): what sim engines run, and the "
        "allocator's model of the engines for either backend",
    )
    p.add_argument("--dtype", default=None, help="--backend vllm: model dtype (float32 on CPUs without bf16)")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="K=V",
        help="one of vLLM's engine arguments for every engine (tensor_parallel_size=2, max_model_len=262144, "
        "...), over Prorsa's defaults; simulated engines honour max_model_len, max_num_seqs and "
        "max_num_batched_tokens; repeatable (default: none)",
    )
    p.add_argument(
        "--engine-args-file",
        default=None,
        help="engine arguments from a file (one JSON object, or K=V lines); --engine-arg wins (default: none)",
    )
    p.add_argument(
        "--role-engine-arg",
        action="append",
        default=[],
        metavar="ROLE:K=V",
        help="--backend vllm: an engine argument for one role (decode:data_parallel_size=2); a switch between "
        "roles whose arguments differ restarts the engine; repeatable (default: none)",
    )
    p.add_argument(
        "--devices-per-engine",
        type=int,
        default=0,
        help="accelerators per engine: engine i gets the i-th group as CUDA_VISIBLE_DEVICES (default 0: every "
        "engine sees every device)",
    )
    p.add_argument(
        "--devices",
        default=None,
        help="the devices to divide among engines, e.g. 0-7 or 0,1,4,5 (default: 0 .. engines x "
        "devices-per-engine - 1)",
    )
    p.add_argument("--speedup", type=float, default=None, help="sim backend: virtual seconds per wall second")
    p.add_argument("--log-dir", default=None, help="write each child's log here (default: discard)")
    p.add_argument("--for", dest="for_s", type=float, default=None, help="stop after this many seconds")
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="embedded server: accept anyone (default: credentials and per-role permissions)",
    )
    p.add_argument(
        "--secrets-dir",
        default=None,
        help="embedded server: keep the credentials here, reused when present (default: a temporary directory "
        "removed on stop)",
    )
    p.add_argument("--tls-cert", default=None, help="embedded server: serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", default=None, help="its private key (PEM)")
    p.add_argument(
        "--tls-ca", default=None, help="CA clients verify the certificate with (default: the cert)"
    )
    p.add_argument(
        "--gateway-port",
        type=int,
        default=0,
        help="HTTP gateway (OpenAI API) on this loopback port (default 0: a free port; -1: no gateway)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the gateway's tokenizer directory (default: the model's, else a tiny chat tokenizer built here)",
    )
    p.add_argument(
        "--start-timeout-s",
        type=float,
        default=None,
        help="how long to wait for every service to report healthy (default: 60 s; 600 s with --backend vllm)",
    )


def engine_args(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    if args.profile:
        out += ["--profile", args.profile]
    if args.speedup:
        out += ["--speedup", str(args.speedup)]
    if args.dtype:
        out += ["--dtype", args.dtype]
    for item in args.engine_arg:
        out += ["--engine-arg", item]
    if args.engine_args_file:
        out += ["--engine-args-file", os.path.abspath(args.engine_args_file)]
    for item in args.role_engine_arg:
        out += ["--role-engine-arg", item]
    return out


def engine_devices(args: argparse.Namespace) -> list[str]:
    """CUDA_VISIBLE_DEVICES per engine (`prorsa.engine_layout`). Raises SystemExit on a layout that cannot be."""
    from prorsa.engine_layout import device_groups, parse_devices

    try:
        devices = parse_devices(args.devices) if args.devices else None
        return device_groups(args.engines, args.devices_per_engine, devices)
    except ValueError as exc:
        raise SystemExit(f"prorsa up: {exc}") from None


# A real engine loads its model and warms up before it reports ok: ~30-90 s per vLLM engine on a small CPU machine
# (engines start in parallel and share its cores), so the default wait is much longer than for simulated engines.
DEFAULT_START_TIMEOUT_S = {"sim": 60.0, "vllm": 600.0}
STOP_TIMEOUT_S = {"sim": 15.0, "vllm": 30.0}


def tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """--tls-cert/--tls-key/--tls-ca as TlsFiles (None without TLS). Raises SystemExit when one is missing."""
    if not (args.tls_cert or args.tls_key):
        return None
    if not (args.tls_cert and args.tls_key):
        raise SystemExit("prorsa up: --tls-cert and --tls-key go together")
    return TlsFiles(args.tls_cert, args.tls_key, args.tls_ca or "")


async def wait_healthy(
    url: str,
    namespace: str,
    expected: list[str],
    timeout_s: float,
    give_up: Callable[[], bool] = lambda: False,
    credentials: BusCredentials | None = None,
    on_poll: Callable[[], None] = lambda: None,
) -> list:
    """Poll health until every expected service answers ok, time runs out or `give_up()` (Ctrl-C); `on_poll()`
    runs before each poll (supervision). Returns the last replies. `credentials`: whom to ask as (default: the
    environment's)."""
    from nats.errors import Error as NatsError

    from prorsa.health import gather_health

    deadline = time.monotonic() + timeout_s  # wall: how long a person waits for the system to come up
    replies: list = []
    while time.monotonic() < deadline and not give_up():
        on_poll()
        try:
            replies = await gather_health(url, namespace, wait_s=0.5, credentials=credentials)
        except (ConnectionError, OSError, TimeoutError, NatsError):  # the server is being restarted
            await asyncio.sleep(0.2)
            continue
        have = sorted(r.service for r in replies if r.status == "ok")
        if have == sorted(expected):
            break
    return replies


def report(events: list) -> None:
    """Print supervision events (`System.supervise`): every exit and restart, crash loops named as such."""
    from prorsa.supervisor import Exit

    for ev in events:
        if isinstance(ev, Exit):
            loop = " — CRASH LOOP (still retrying)" if ev.crash_loop else ""
            print(
                f"up: {ev.key} exited with code {ev.returncode} after {ev.ran_s:.1f} s; "
                f"restart {ev.restarts} in {ev.delay_s:.1f} s{loop}",
                flush=True,
            )
        else:
            print(f"up: {ev.key} restarted (restart {ev.restarts})", flush=True)


def run(args: argparse.Namespace) -> int:
    from prorsa.health import format_health
    from prorsa.system import System, SystemConfig

    if args.backend == "vllm" and args.engines and not args.model:
        print("prorsa up: --backend vllm needs --model PATH (a local model directory)")
        return 2
    namespace = namespace_from_env(args.namespace)
    gateway = _gateway_setup(args)
    system = System(
        SystemConfig(
            nats_url=nats_url_from_env(args.nats),
            namespace=namespace,
            engines=args.engines,
            backend=args.backend,
            model=args.model,
            extra_engine_args=engine_args(args),
            engine_devices=engine_devices(args),
            extra_service_args={"allocator": ["--profile", args.profile]} if args.profile else {},
            log_dir=args.log_dir,
            auth=not args.no_auth,
            secrets_dir=args.secrets_dir,
            tls=tls_files(args),
            gateway_port=gateway[0],
            gateway_args=gateway[1],
        )
    )
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    system.start()
    try:
        print(f"nats: {system.url}", flush=True)
        if system.gateway_url:
            print(f"openai: {system.gateway_url}", flush=True)
        if system.secrets is not None:
            path = system.secrets.path
            print(
                f"credentials: {path} (source {path}/trainer.env, or operator.env for `prorsa status`)",
                flush=True,
            )
        expected = system.expected_services()
        timeout_s = args.start_timeout_s or DEFAULT_START_TIMEOUT_S[args.backend]
        if args.backend == "vllm":
            print(f"engines: loading vLLM engines (waiting up to {timeout_s:.0f} s)", flush=True)
        replies = asyncio.run(
            wait_healthy(
                system.url,
                namespace,
                expected,
                timeout_s,
                give_up=lambda: stop["now"],
                on_poll=lambda: report(system.supervise()),
                credentials=system.credentials("operator"),
            )
        )
        print(format_health(replies), flush=True)
        if system.gateway_url:
            from prorsa.gateway.launch import wait_gateway

            ok = wait_gateway(system.gateway_url, timeout_s, give_up=lambda: stop["now"])
            print(
                f"gateway: {'ok' if ok else 'not answering (see its log)'} at {system.gateway_url}",
                flush=True,
            )
        healthy = sum(1 for r in replies if r.status == "ok")
        print(f"up: {healthy}/{len(expected)} services healthy; Ctrl-C stops", flush=True)
        deadline = time.monotonic() + args.for_s if args.for_s else None
        while not stop["now"] and (deadline is None or time.monotonic() < deadline):
            report(system.supervise())  # a child that died is restarted; the others never stop for it
            time.sleep(0.2)
        restarts = system.supervisor.restarts()
        if restarts:
            looping = system.supervisor.crash_looping(time.monotonic())
            print(f"up: restarts {restarts}" + (f"; crash-looping: {looping}" if looping else ""), flush=True)
    finally:
        # A vLLM engine agent hands on its work and shuts its engine down (vLLM waits up to 5 s for the engine
        # process) before it exits: give it longer than a simulated one before it is killed.
        system.stop(timeout_s=STOP_TIMEOUT_S[args.backend])
        if gateway[2]:
            shutil.rmtree(gateway[2], ignore_errors=True)
        print("up: stopped", flush=True)
    return 0


def _gateway_setup(args: argparse.Namespace) -> tuple[int | None, list[str], str]:
    """(gateway port or None, its arguments, a temporary tokenizer directory to remove or "")."""
    if args.gateway_port < 0:
        return None, [], ""
    from prorsa.gateway.launch import default_tokenizer, free_port, model_window

    tokenizer, temporary = (args.tokenizer, False) if args.tokenizer else default_tokenizer(args.model)
    port = args.gateway_port or free_port()
    extra = ["--tokenizer", tokenizer]
    window = model_window(args.model) if args.model else None
    if window:  # the gateway refuses a turn past the model's window itself, with a 400 that says so
        extra += ["--max-model-len", str(window)]
    return port, extra, tokenizer if temporary else ""

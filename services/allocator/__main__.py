"""`python -m services.allocator --nats URL --policy prorsa --profile qwen3-235b --interval-s 5`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from services.allocator.service import AllocatorService
from services.allocator.switch_coordinator import DRAIN_TIMEOUT_S
from services.runtime.main import run_service_main


def _extend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="prorsa", help="policy spec: name[:key=value...] (default: prorsa)")
    p.add_argument(
        "--profile",
        default="auto",
        help="engine performance profile: built-in name, JSON file, or auto (what the engines report, "
        "else qwen3-235b)",
    )
    p.add_argument(
        "--interval-s", type=float, default=None, help="seconds between decisions (default: the policy's)"
    )
    p.add_argument(
        "--engines", type=int, default=None, help="fleet size the policy is built for (default: engines seen)"
    )
    p.add_argument(
        "--stale-after-s", type=float, default=5.0, help="ignore engines whose stats are older than this"
    )
    p.add_argument(
        "--ack-timeout-s", type=float, default=60.0, help="forget an unacknowledged command after this"
    )
    p.add_argument(
        "--command-timeout-s", type=float, default=45.0, help="wait this long for a command's reply"
    )
    p.add_argument(
        "--max-concurrent-fraction", type=float, default=0.25, help="most engines switching at once"
    )
    p.add_argument(
        "--drain-timeout-s", type=float, default=DRAIN_TIMEOUT_S, help="drain bound sent with each command"
    )


def _make(args: argparse.Namespace, url: str, namespace: str) -> AllocatorService:
    return AllocatorService(
        url,
        namespace,
        args.instance_id,
        args.metrics_port,
        policy=args.policy,
        profile=args.profile,
        interval_s=args.interval_s,
        n_engines=args.engines,
        stale_after_s=args.stale_after_s,
        ack_timeout_s=args.ack_timeout_s,
        command_timeout_s=args.command_timeout_s,
        max_concurrent_fraction=args.max_concurrent_fraction,
        drain_timeout_s=args.drain_timeout_s,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_service_main(
        _make, "Prorsa allocator: prefill/decode roles from forecasts and engine stats", argv, _extend
    )


if __name__ == "__main__":
    raise SystemExit(main())

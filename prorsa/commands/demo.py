"""`prorsa demo`: the main job on the embedded default.

Starts the system (embedded nats-server, every service, simulated engines), shows it alive through the health
replies of every service, and stops it. The rollout comparison (`colocated` vs `prorsa`) replaces this once the
rollout driver exists; until then the demo reports only what it observed.
"""

from __future__ import annotations

import argparse

from prorsa.commands import up


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--backend", choices=("sim", "vllm"), default="sim")
    p.add_argument("--model", default=None)
    p.add_argument("--seconds", type=float, default=5.0, help="how long to keep the system up")


def run(args: argparse.Namespace) -> int:
    ns = argparse.Namespace(
        nats=None,
        namespace=None,
        engines=args.engines,
        backend=args.backend,
        model=args.model,
        profile=None,
        speedup=None,
        log_dir=None,
        for_s=args.seconds,
    )
    return up.run(ns)

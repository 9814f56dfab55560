"""`prorsa chaos`: the fault campaign (`prorsa.bench.faults`) — a rollout on simulated engines while engines,
services and the nats-server are killed and every consumed subject is flooded; prints a table, writes JSON."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from prorsa.bench import faults

    faults.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from prorsa.bench import faults

    return faults.run(args)

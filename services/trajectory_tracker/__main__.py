"""`python -m services.trajectory_tracker [--nats URL] [--snapshot-interval-s 1.0] [--checkpoint-interval-s 5]`:
run the tracker alone."""

from __future__ import annotations

import argparse

from services.runtime.main import run_service_main
from services.trajectory_tracker.core import TrackerConfig
from services.trajectory_tracker.service import TrackerService


def _extend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--snapshot-interval-s", type=float, default=1.0, help="seconds between snapshots")
    p.add_argument(
        "--checkpoint-interval-s",
        type=float,
        default=5.0,
        help="wall seconds between state checkpoints in the tracker's object store (0: none, replay everything)",
    )
    p.add_argument(
        "--silent-after-s", type=float, default=30.0, help="wall seconds without an event: flagged silent"
    )
    p.add_argument(
        "--lost-after-s", type=float, default=600.0, help="wall seconds without an event: marked lost"
    )


def _make(args: argparse.Namespace, url: str, namespace: str) -> TrackerService:
    return TrackerService(
        url,
        namespace=namespace,
        instance_id=args.instance_id,
        metrics_port=args.metrics_port,
        snapshot_interval_s=args.snapshot_interval_s,
        checkpoint_interval_s=args.checkpoint_interval_s or None,
        config=TrackerConfig(silent_after_s=args.silent_after_s, lost_after_s=args.lost_after_s),
    )


def main(argv: list[str] | None = None) -> int:
    return run_service_main(_make, "Prorsa trajectory tracker", argv, extend=_extend)


if __name__ == "__main__":
    raise SystemExit(main())

"""`prorsa status --nats URL`: list live services and engines from their health replies."""

from __future__ import annotations

import argparse
import asyncio

from services.runtime.bus import BUS_ERRORS, namespace_from_env, nats_url_from_env
from services.runtime.credentials import CredentialsError, add_credential_arguments, credentials_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", default=None, help="NATS URL (default: $PRORSA_NATS_URL)")
    p.add_argument("--namespace", default=None)
    p.add_argument("--wait-s", type=float, default=1.0, help="how long to gather replies")
    add_credential_arguments(p)  # e.g. the operator's, from `prorsa up`'s credentials directory


def run(args: argparse.Namespace) -> int:
    from prorsa.health import format_health, gather_health

    url = nats_url_from_env(args.nats)
    if not url:
        print(
            "prorsa status: give --nats URL (printed by `prorsa up` on its `nats:` line) or set PRORSA_NATS_URL"
        )
        return 2
    try:
        replies = asyncio.run(
            gather_health(url, namespace_from_env(args.namespace), args.wait_s, credentials_from_args(args))
        )
    except (*BUS_ERRORS, CredentialsError) as exc:  # no server there, or no way in: say so plainly
        print(f"prorsa status: cannot reach NATS at {url}: {exc!r}")
        return 1
    print(format_health(replies))
    return 0 if replies and all(r.status == "ok" for r in replies) else 1

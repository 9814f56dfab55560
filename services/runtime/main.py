"""Command-line entry shared by the services: `python -m services.<name> [--nats URL] ...`.

With no `--nats` and no $PRORSA_NATS_URL, an embedded nats-server is started for the lifetime of the service
(open to local clients: `prorsa up` is the way to a server with credentials). Credentials come from the
PRORSA_NATS_* environment (`credentials.py`), with `--nkey`, `--inbox-prefix` and `--tls-ca` over it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable, Sequence

from services.runtime.bus import namespace_from_env, nats_url_from_env
from services.runtime.credentials import add_credential_arguments, credentials_from_args
from services.runtime.logging import configure_logging
from services.runtime.nats_server import EmbeddedNatsServer
from services.runtime.service import Service


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--nats", default=None, help="NATS URL (default: $PRORSA_NATS_URL, else an embedded server)"
    )
    p.add_argument(
        "--namespace", default=None, help="subject namespace (default: $PRORSA_NAMESPACE or 'prorsa')"
    )
    p.add_argument("--instance-id", default=None, help="instance id used in logs and health replies")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("PRORSA_METRICS_PORT", "0")) or None,
        help="serve Prometheus metrics on this port",
    )
    add_credential_arguments(p)
    return p


def run_service_main(
    make: Callable[[argparse.Namespace, str, str], Service],
    description: str,
    argv: Sequence[str] | None = None,
    extend: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """Parse the common options (plus `extend`'s), start an embedded server if needed, run until a signal."""
    parser = base_parser(description)
    if extend is not None:
        extend(parser)
    args = parser.parse_args(argv)
    configure_logging()
    url = nats_url_from_env(args.nats)
    embedded = None
    if url is None:
        embedded = EmbeddedNatsServer().start()
        url = embedded.url
        print(f"nats: {url}", flush=True)
    try:
        service = make(args, url, namespace_from_env(args.namespace))
        service.credentials = credentials_from_args(args)
        asyncio.run(service.run())
    finally:
        if embedded is not None:
            embedded.stop(remove_store=True)
    return service.exit_code

"""`prorsa secrets DIR`: write bus credentials for a cluster run from outside `prorsa up` (docker/compose.yaml).

One nkey per role, the servers' `auth.conf` (public keys and permissions) and `cluster-auth.conf` (route
credentials), and a `<role>.env` per role, into DIR (0700, files 0600). Prints the path and what is there, never
a secret. `docker/compose.yaml` expects `prorsa secrets docker/secrets`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from services.runtime.bus import namespace_from_env

# The route ports of docker/compose.yaml's three nodes.
COMPOSE_ROUTES = ("nats-1:6222", "nats-2:6222", "nats-3:6222")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="directory to write (created 0700)")
    p.add_argument(
        "--namespace", default=None, help="subject namespace (default: $PRORSA_NAMESPACE or 'prorsa')"
    )
    p.add_argument(
        "--url",
        default="nats://127.0.0.1:4222",
        help="server URL written into the .env files (default: compose's published port)",
    )
    p.add_argument(
        "--routes",
        default=",".join(COMPOSE_ROUTES),
        help="the cluster's nodes, host:port of each route port, comma-separated (default: compose's three)",
    )
    p.add_argument("--force", action="store_true", help="replace credentials already in DIR")


def run(args: argparse.Namespace) -> int:
    from services.runtime.bus_secrets import generate

    if (Path(args.dir) / "users.json").exists() and not args.force:
        print(f"prorsa secrets: {args.dir} already holds credentials (--force replaces them)")
        return 1
    routes = tuple(r.strip() for r in args.routes.split(",") if r.strip())
    secrets = generate(args.dir, namespace_from_env(args.namespace), url=args.url, routes=routes)
    print(f"credentials: {secrets.path}")
    print(
        f"users: {', '.join(secrets.users)} (each <user>.nk and <user>.env; source an .env to act as that user)"
    )
    print("servers: auth.conf (users and permissions), cluster-auth.conf (route credentials), server.conf")
    return 0

"""Where other engines reach this engine's KV: the NIXL side channel's host and ports, across hosts.

A decode engine pulls a prompt's KV from the prefill engine at the host and port the handoff names
(`VLLM_NIXL_SIDE_CHANNEL_HOST` / `_PORT`, copied into `kv_transfer_params`). On one host, 127.0.0.1 serves; once
engines run on several hosts it must be an address the others can route to, or every cross-host handoff fails
into a re-prefill. Without `--nixl-host` the agent takes the address it reaches the NATS server from (the
interface facing the cluster) whenever the NATS URL names a routable address — this host's own included, as on
the node that runs the NATS server while engines on other nodes join it — and 127.0.0.1 only when the URL is a
loopback one (a single-host cluster). Given one, a loopback address is refused while the NATS server is on another
host (its peers may be anywhere). Data-parallel rank r of an engine listens on port + r (vLLM's rule), so an engine
needs a block of `dp` free ports.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"


class KvHostError(ValueError):
    """The side-channel address cannot serve the cluster as configured (names the address and why)."""


def nats_hosts(url: str) -> list[str]:
    """The hosts of a NATS URL (a comma-separated list of servers is allowed)."""
    hosts = []
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        host = urlsplit(part if "://" in part else f"nats://{part}").hostname
        if host:
            hosts.append(host)
    return hosts


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or a name that resolves only to loopback addresses (`localhost`)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False  # unresolvable here: not known to be this host
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def address_towards(host: str, port: int = 4222) -> str:
    """This host's address on the route to `host` (a UDP `connect` picks the interface; nothing is sent).
    Raises KvHostError when there is no route."""
    try:
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError as exc:
        raise KvHostError(f"no route from this host to {host}: {exc.strerror or exc}") from None


def _remote(hosts: list[str]) -> list[str]:
    """The hosts that are not this machine (an address of this machine routes to itself)."""
    out = []
    for host in hosts:
        if is_loopback(host):
            continue
        with contextlib.suppress(KvHostError):
            if address_towards(host) == host:
                continue  # one of this machine's own addresses
        out.append(host)
    return out


def choose_nixl_host(given: str | None, nats_url: str) -> str:
    """The side-channel host to announce (see the module docstring). Raises KvHostError when `given` is a
    loopback address and the NATS server is on another host."""
    hosts = nats_hosts(nats_url)
    remote = _remote(hosts)
    if given:
        if is_loopback(given) and remote:
            raise KvHostError(
                f"--nixl-host {given} is a loopback address, but the NATS server is on another host "
                f"({remote[0]}): engines there could not pull KV from this one. Give an address they can route "
                "to (or leave --nixl-host out: the address facing the NATS server is used)"
            )
        return given
    routable = [h for h in hosts if not is_loopback(h)]
    if not routable:
        return LOOPBACK
    return address_towards(routable[0])


def free_port_block(n: int, host: str = "", tries: int = 64) -> int:
    """A port p with p .. p + n - 1 all free on `host` (all interfaces by default) now. Raises KvHostError
    when none is found in `tries` attempts."""
    for _ in range(tries):
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            s.bind((host, 0))
            base = int(s.getsockname()[1])
        if base + n - 1 > 65535:
            continue
        if all(_free(host, base + i) for i in range(1, n)):
            return base
    raise KvHostError(f"no block of {n} free ports found")


def _free(host: str, port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True

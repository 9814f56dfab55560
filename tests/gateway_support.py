"""Shared pieces of the gateway tests that run a gateway process against in-process simulated engines (a real
nats-server): lighter than `prorsa up` when a test needs only the gateway and engines. The fixtures are in
conftest.py (`gateway_bus`, `gateway_process`, `sim_gateway`)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

from prorsa.gateway.launch import default_tokenizer


def start_gateway(url: str, port: int, *extra: str) -> subprocess.Popen:
    """A gateway process on `port` serving chat with the tiny tokenizer (what `prorsa up` serves by default)."""
    tokenizer, _ = default_tokenizer(None)
    args = ["--nats", url, "--port", str(port), "--tokenizer", tokenizer, *extra]
    return subprocess.Popen([sys.executable, "-m", "prorsa.gateway", *args])


def errors(base: str, kind: str) -> float:
    """The gateway's count of refusals of `kind` (its /metrics)."""
    with urllib.request.urlopen(f"{base.removesuffix('/v1')}/metrics", timeout=10) as r:
        text = r.read().decode()
    line = f'prorsa_gateway_errors_total{{kind="{kind}"}} '
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))

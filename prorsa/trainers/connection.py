"""Where a trainer's processes reach the cluster: a picklable description that connects lazily, once per process and
event loop.

Trainers move their rollout client around: verl pickles its LLM client into every `AgentLoopWorker` Ray actor,
AReaL runs workflows in a background thread with its own event loop while the trainer calls weight updates from the
main thread. A `RolloutClient` cannot travel that way: its NATS connection, subscriptions and tasks belong to the
event loop that created them (pickling one fails on an `asyncio.Task`, and using one from another loop fails or
hangs). So a trainer holds a `Connection` instead: the server URL, the credentials (file paths and names, never
a seed's contents), the namespace and the clock scale, captured where it is built. `await conn.client()` returns the
client of the running event loop in this process, connecting on first use; a pickled copy starts with no clients
and connects in its new home.

    conn = Connection.from_env()          # PRORSA_NATS_URL, PRORSA_NATS_* (source trainer.env), PRORSA_NAMESPACE
    client = await conn.client()          # this process, this loop: connected once, then reused
    await conn.close()                    # this loop's client (others close with their own loops)
    async with conn.session() as client:  # a client for one operation, closed after: for a loop that will not last
        ...

verl runs many of its calls through `asyncio.run` (a fresh loop each time), so what a trainer calls once per step
(a weight update) uses a session; what runs per turn uses `client()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.runtime.clock import Clock
from services.runtime.credentials import BusCredentials


class NoClusterError(ValueError):
    """A `Connection` that names no cluster (no URL)."""


@dataclass
class _LoopClient:
    loop: asyncio.AbstractEventLoop  # held so that a new loop reusing a dead one's id() is told apart
    client: Any  # RolloutClient (imported lazily: its module pulls in nats)


@dataclass
class Connection:
    """How to reach a Prorsa cluster as a trainer. Picklable; `client()` connects per process and event loop.

    `client_options` go to `RolloutClient` (e.g. `retry_after_s`, `lean_wire`); `time_scale` is the cluster's
    clock scale (1 with real engines; the `PRORSA_TIME_SCALE` of a simulated cluster). `discovery_s`: how long a
    new `client()` listens to engine stats before it returns (engines report every second): a client that knows no
    engine sends a trajectory's next turn to any engine instead of the one holding its prefix, so a fresh worker
    process would lose its first turns' prefix caches (0: return at once)."""

    url: str
    credentials: BusCredentials = field(default_factory=BusCredentials)
    namespace: str = "prorsa"
    time_scale: float = 1.0
    client_options: dict[str, Any] = field(default_factory=dict)
    discovery_s: float = 1.2
    # Per process: clients by id(loop) and the pid that made them (a fork or a pickle starts empty).
    _clients: dict[int, _LoopClient] = field(default_factory=dict, init=False, repr=False, compare=False)
    _locks: dict[int, asyncio.Lock] = field(default_factory=dict, init=False, repr=False, compare=False)
    _pid: int = field(default_factory=os.getpid, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.url:
            raise NoClusterError(
                "no NATS URL: pass one, or set PRORSA_NATS_URL (`source DIR/trainer.env` after `prorsa up`)"
            )
        Clock(self.time_scale)  # raises ValueError on a scale that is not a positive number

    @classmethod
    def from_env(cls, url: str | None = None, **client_options: Any) -> Connection:
        """From the environment a `trainer.env` of `prorsa up` sets: PRORSA_NATS_URL (unless `url`), the
        PRORSA_NATS_* credentials, PRORSA_NAMESPACE and PRORSA_TIME_SCALE. Raises NoClusterError without a URL."""
        scale = Clock.from_env().scale
        return cls(
            url=url or os.environ.get("PRORSA_NATS_URL", ""),
            credentials=BusCredentials.from_env(),
            namespace=os.environ.get("PRORSA_NAMESPACE", "prorsa"),
            time_scale=scale,
            client_options=dict(client_options),
        )

    def __getstate__(self) -> dict[str, Any]:
        # Connections, locks and tasks stay behind: the copy connects in its own process and loop.
        state = dict(self.__dict__)
        state["_clients"], state["_locks"] = {}, {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()

    def _own(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's sockets are not ours to use
            self._clients, self._locks, self._pid = {}, {}, os.getpid()

    async def _connect(self) -> Any:
        from prorsa.client.client import RolloutClient

        return await RolloutClient.connect(
            self.url,
            credentials=self.credentials,
            namespace=self.namespace,
            clock=Clock(self.time_scale),
            **self.client_options,
        )

    async def client(self) -> Any:
        """The `RolloutClient` of the running event loop in this process, connected on first use. Raises what
        `RolloutClient.connect` raises (CredentialsError for refused credentials)."""
        self._own()
        # Clients of loops that have closed are dead (their loop ran them): forget them.
        for key in [k for k, c in self._clients.items() if c.loop.is_closed()]:
            del self._clients[key]
            self._locks.pop(key, None)
        loop = asyncio.get_running_loop()
        key = id(loop)
        have = self._clients.get(key)
        if have is not None and have.loop is loop:
            return have.client
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # two coroutines of one loop asking at once share one connection
            have = self._clients.get(key)
            if have is not None and have.loop is loop:
                return have.client
            client = await self._connect()
            await asyncio.sleep(self.discovery_s)  # a round of engine stats: affinity from the first turns on
            self._clients[key] = _LoopClient(loop, client)
            return client

    async def close(self) -> None:
        """Close this loop's client, if it has one (a client belongs to its loop: others close from theirs)."""
        self._own()
        loop = asyncio.get_running_loop()
        have = self._clients.pop(id(loop), None)
        self._locks.pop(id(loop), None)
        if have is not None and have.loop is loop:
            await have.client.close()

    def close_all(self, timeout_s: float = 5.0) -> None:
        """From a thread without a running loop of ours: close the clients of the loops still running in other
        threads (AReaL's rollout thread at `destroy`), each in its own loop, waiting up to `timeout_s` for each. A
        client whose loop has stopped cannot be closed any more; its socket goes with the process."""
        self._own()
        try:
            mine = asyncio.get_running_loop()
        except RuntimeError:
            mine = None
        for key, have in list(self._clients.items()):
            if have.loop is mine:
                continue  # waiting here on our own loop would deadlock: `await close()` closes this one
            if have.loop.is_running() and not have.loop.is_closed():
                future = asyncio.run_coroutine_threadsafe(have.client.close(), have.loop)
                with contextlib.suppress(TimeoutError):  # a wedged loop must not hang the trainer's shutdown
                    future.result(timeout_s)
            self._clients.pop(key, None)
            self._locks.pop(key, None)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Any]:
        """A `RolloutClient` of its own for one operation, closed when the block ends."""
        client = await self._connect()
        try:
            yield client
        finally:
            await client.close()

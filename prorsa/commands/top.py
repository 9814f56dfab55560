"""`prorsa top --nats URL`: a refreshing terminal view of a running cluster (rich Live).

The shell around `prorsa.top.state.TopState`: it subscribes to the subjects an operator watches (engine stats
and acks, the allocator's plans, the tracker's snapshots, the forecasts, the lifecycle subject for realised
demand), asks every service for its health, feeds what arrives to the core and redraws the core's view every
`--interval-s`. Bad input ends in a sentence, never a traceback: no server at the URL, no service on the bus, or
services that speak another schema version; a bad message during the run is counted and shown.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import TYPE_CHECKING, Any

from services.runtime.bus import namespace_from_env, nats_url_from_env
from services.runtime.credentials import BusCredentials

if TYPE_CHECKING:
    from rich.console import Console


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", default=None, help="NATS URL (default: $PRORSA_NATS_URL)")
    p.add_argument("--namespace", default=None)
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between redraws")
    p.add_argument("--for", dest="for_s", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--probe-s", type=float, default=1.5, help="how long to wait for health replies at start")


def run(args: argparse.Namespace) -> int:
    from nats.errors import Error as NatsError
    from rich.console import Console

    console = Console()
    url = nats_url_from_env(args.nats)
    if not url:
        console.print(
            "prorsa top: give --nats URL (printed by `prorsa up` on its `nats:` line) or set PRORSA_NATS_URL"
        )
        return 2
    try:
        return asyncio.run(
            watch(url, namespace_from_env(args.namespace), console, args.for_s, args.interval_s, args.probe_s)
        )
    except KeyboardInterrupt:
        return 0
    except (OSError, ConnectionError) as exc:
        console.print(f"prorsa top: cannot reach NATS at {url}: {exc}")
        return 1
    except NatsError as exc:  # e.g. the server went away for good while watching
        console.print(f"prorsa top: lost NATS at {url}: {exc!r}")
        return 1


async def watch(
    url: str,
    namespace: str,
    console: Console,
    for_s: float | None = None,
    interval_s: float = 1.0,
    probe_s: float = 1.5,
    credentials: BusCredentials | None = None,
) -> int:
    """Watch the cluster at `url` until `for_s` seconds have passed (None: until interrupted). Returns the exit
    status: 0 after watching, 1 when nothing on the bus can be shown (the reason printed). Raises OSError /
    ConnectionError when no server answers at `url`. `credentials`: whom to watch as (default: the PRORSA_NATS_*
    environment's, e.g. `source DIR/operator.env` after `prorsa up`)."""
    import nats
    from nats.errors import NoServersError
    from rich.live import Live

    import proto
    from prorsa.health import check_reachable
    from prorsa.top.render import render
    from prorsa.top.state import TopState

    check_reachable(url)

    async def quiet(exc: Exception) -> None:  # connection trouble is reported by the caller, once
        return None

    creds = credentials if credentials is not None else BusCredentials.from_env()
    try:
        nc = await nats.connect(
            url, connect_timeout=2, max_reconnect_attempts=3, error_cb=quiet, **creds.connect_options()
        )
    except NoServersError as exc:
        raise ConnectionError(str(exc)) from None
    state = TopState()
    try:
        probe = await _subscribe(nc, state, proto.Subjects(namespace))
        await probe()
        await asyncio.sleep(probe_s)
        problem = state.startup_problem()
        if problem is not None:
            console.print(
                f"prorsa top: {problem} at {url} (namespace {namespace!r}). "
                "Start the system with `prorsa up`, or check --nats and --namespace.",
                soft_wrap=True,
            )
            return 1
        title = f"prorsa top · {url} · namespace {namespace}"
        # Wall seconds: refresh cadence and "last heard" ages (TopState's `now`), never compared with a bus stamp.
        start = asked = time.monotonic()
        with Live(render(state.view(time.monotonic()), title), console=console, auto_refresh=False) as live:
            while for_s is None or time.monotonic() - start < for_s:
                await asyncio.sleep(interval_s)
                if time.monotonic() - asked > 10.0:  # services come and go: ask again now and then
                    asked = time.monotonic()
                    await probe()
                live.update(render(state.view(time.monotonic()), title), refresh=True)
        return 0
    finally:
        await nc.close()


async def _subscribe(nc: Any, state: Any, s: Any) -> Any:
    """Feed every watched subject to `state` (a message that does not decode is counted there, not raised);
    returns the health probe: a coroutine function that asks every service to answer."""
    import proto
    from prorsa.health import ask_health

    def feed(expected: Any) -> Any:
        async def cb(msg: Any) -> None:
            try:
                state.apply(proto.decode(msg.data, msg.subject, expected), time.monotonic())
            except proto.ProtoError as err:
                state.reject(msg.subject, err)

        return cb

    for subject, expected in (
        (s.all_engine_stats, proto.EngineStats),
        (s.all_engine_acks, proto.RoleSwitchAck),
        (s.plan, proto.AllocationPlan),
        (s.snapshot, proto.LifecycleSnapshot),
        (s.forecast, proto.DemandForecast),
        (s.lifecycle, proto.LIFECYCLE_MESSAGES),
    ):
        await nc.subscribe(subject, cb=feed(expected))
    inbox = nc.new_inbox()
    await nc.subscribe(inbox, cb=feed(proto.HealthReply))

    async def probe() -> None:
        await ask_health(nc, s.health, inbox)

    return probe

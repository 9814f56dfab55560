"""One gateway process: a client SDK connection to the bus, the tokenizer, and the HTTP app on uvicorn.

Stateless apart from its sessions (`sessions.py`): run several behind a load balancer that keeps a session on one
process (e.g. by the `X-Prorsa-Trajectory` header); a session that reaches another process, or this one after a
restart, is refused by name (409 `session_lost`, `turns.py`), never forked. It joins the bus as a trainer (`PRORSA_NATS_*`, e.g. the
`trainer.env` that `prorsa up` writes), and requires the API key in `PRORSA_API_KEY` when that is set; the trainer's
control plane (`admin.py`) requires `PRORSA_ADMIN_API_KEY` when that is set.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass, field

from prorsa.gateway.app import HttpConfig, build_app
from prorsa.gateway.chat_template import ChatTokenizer
from prorsa.gateway.metrics import GatewayMetrics
from prorsa.gateway.turns import Gateway, GatewayConfig
from services.runtime.credentials import BusCredentials
from services.runtime.logging import get_logger

API_KEY_ENV = "PRORSA_API_KEY"
ADMIN_API_KEY_ENV = (
    "PRORSA_ADMIN_API_KEY"  # the control plane's (/v1/weights, /v1/pause, ...); unset: API_KEY_ENV's
)
log = get_logger("gateway", "")


@dataclass
class ServeConfig:
    nats_url: str
    namespace: str = "prorsa"
    host: str = "127.0.0.1"
    port: int = 8000
    tokenizer: str | None = None
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    admission_timeout_s: float = 10.0  # a turn refused by full work queues this long is a 429
    credentials: BusCredentials | None = None


async def serve(config: ServeConfig) -> None:
    """Run until SIGINT/SIGTERM (uvicorn's handlers). Raises OSError when the port is taken, OSError/TemplateError
    for a tokenizer directory that cannot be loaded, CredentialsError for refused bus credentials."""
    import uvicorn

    from prorsa.client.client import RolloutClient

    tokenizer = ChatTokenizer.load(config.tokenizer) if config.tokenizer else None
    client = await RolloutClient.connect(
        config.nats_url,
        config.credentials,
        namespace=config.namespace,
        client_id=f"gateway-{uuid.uuid4().hex[:8]}",
        admission_timeout_s=config.admission_timeout_s,
    )
    gw = Gateway(client, tokenizer, config.gateway, GatewayMetrics())
    if not config.http.api_key:
        log.warning("gateway_open", hint=f"set {API_KEY_ENV} to require an API key")
    app = build_app(gw, config.http)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list | None = None) -> None:
            aborted = await gw.abort_all()  # before uvicorn waits for (then cancels) the turns still running
            log.info("gateway_stopping", turns_aborted=aborted)
            await super().shutdown(sockets=sockets)

    server = Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            # An agent's connection idles through its tool call: keep it longer than uvicorn's 5 s, so a
            # client reusing it rarely races the server closing it.
            timeout_keep_alive=75,
            # On SIGTERM, turns still running after this long are cancelled (their trajectories stay on the bus).
            timeout_graceful_shutdown=5,
        )
    )

    async def sweep() -> None:
        while True:
            await asyncio.sleep(min(60.0, config.gateway.session_idle_s / 4))
            await gw.close_idle(time.monotonic())

    sweeper = asyncio.create_task(sweep())
    try:
        await server.serve()
    finally:
        sweeper.cancel()
        await client.close()


def api_key_from_env() -> str:
    return os.environ.get(API_KEY_ENV, "")


def admin_api_key_from_env() -> str:
    return os.environ.get(ADMIN_API_KEY_ENV, "")

"""The trainer's control plane over HTTP: weight updates with a barrier, pause/resume, abort by version.

  POST /v1/weights  {version, source?, timeout_s?, mode?}  -> 200 the barrier's ack (every live engine serves it)
                                                              504 some engines do not within timeout_s (named)
                                                              409 engines failed to load it, or a stale version
  POST /v1/pause    {reason?, timeout_s?}                   -> 200 {paused: true, engines}; 504 naming laggards
  POST /v1/resume   {reason?, timeout_s?}                   -> 200 {paused: false, engines}
  POST /v1/abort    {older_than, reason?, timeout_s?}       -> 200 the turns aborted (this gateway's, with their
                                                              partial outputs and per-token versions)

They are the SDK's `RolloutClient.update_weights`, `pause`, `resume` and `abort_older_than` (proto/README.md, "Policy
versions"). They need the admin key (`PRORSA_ADMIN_API_KEY`) when one is set, else the gateway's key: an agent that
may only generate must not swap the policy under everyone else. Error bodies are OpenAI's shape plus `engines`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from prorsa.client.weights import PauseError, WeightUpdateError
from prorsa.gateway.schemas import _Strict

MAX_VERSION = 2**53 - 1
MAX_TIMEOUT_S = 3600.0


class WeightsBody(_Strict):
    version: int = Field(ge=0, le=MAX_VERSION)
    source: str = Field("", max_length=4096)
    timeout_s: float = Field(300.0, gt=0, le=MAX_TIMEOUT_S)
    mode: Literal["drain", "inflight"] = "drain"


class PauseBody(_Strict):
    reason: str = Field("", max_length=500)
    timeout_s: float = Field(30.0, gt=0, le=MAX_TIMEOUT_S)


class AbortBody(_Strict):
    older_than: int = Field(ge=0, le=MAX_VERSION)
    reason: str = Field("", max_length=500)
    timeout_s: float = Field(30.0, gt=0, le=MAX_TIMEOUT_S)


class AdminError(Exception):
    """An admin call the cluster did not carry out: `status`, OpenAI `code`, and the engines concerned."""

    def __init__(
        self, status: int, code: str, message: str, engines: list[str], failed: dict[str, str]
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.engines, self.failed = status, code, engines, failed


class Admin:
    """The handlers; `parse` is the app's body parser (its errors are the app's 400s)."""

    def __init__(self, client: Any, parse: Any) -> None:
        self.client = client
        self.parse = parse

    async def weights(self, request: Request) -> Response:
        body = await self.parse(request, WeightsBody)
        try:
            ack = await self.client.update_weights(
                body.version, body.source, timeout_s=body.timeout_s, mode=body.mode
            )
        except WeightUpdateError as exc:
            status, code = (504, "weights_timeout") if exc.timed_out else (409, "weights_failed")
            raise AdminError(status, code, str(exc), exc.engines, exc.failed) from exc
        except ValueError as exc:  # a version below the current one
            raise AdminError(409, "stale_version", str(exc), [], {}) from exc
        return JSONResponse(
            {
                "object": "weights",
                "version": ack.version,
                "source": ack.source,
                "mode": ack.mode,
                "engines": ack.engines,
                "barrier_s": ack.barrier_s,
            }
        )

    async def pause(self, request: Request) -> Response:
        return await self._set_paused(request, True)

    async def resume(self, request: Request) -> Response:
        return await self._set_paused(request, False)

    async def _set_paused(self, request: Request, paused: bool) -> Response:
        body = await self.parse(request, PauseBody)
        call = self.client.pause if paused else self.client.resume
        try:
            engines = await call(body.reason, timeout_s=body.timeout_s)
        except PauseError as exc:
            raise AdminError(504, "pause_timeout", str(exc), exc.engines, {}) from exc
        return JSONResponse({"object": "generation", "paused": paused, "engines": engines})

    async def abort(self, request: Request) -> Response:
        body = await self.parse(request, AbortBody)
        try:
            results = await self.client.abort_older_than(
                body.older_than, body.reason, timeout_s=body.timeout_s
            )
        except TimeoutError as exc:
            raise AdminError(504, "abort_timeout", str(exc), [], {}) from exc
        aborted = [
            {
                "request_id": r.request_id,
                "finish_reason": r.finish_reason,
                "engine_id": r.engine_id,
                "token_ids": r.token_ids,
                "token_versions": r.token_versions,
                "logprobs": r.logprobs,
            }
            for r in results
        ]
        return JSONResponse({"object": "abort", "older_than": body.older_than, "aborted": aborted})

"""The gateway's HTTP surface (Starlette on uvicorn): OpenAI chat/completions, SGLang `/generate`, sessions.

  POST /v1/chat/completions              chat template applied incrementally; session = trajectory
  POST /v1/completions                   prompt as text or token ids
  POST /generate                         SGLang-shaped token-in/token-out (SSE with stream: true)
  POST /v1/trajectories/{id}/finish      reward and outcome (as the SDK's `finish`)
  POST /v1/trajectories/{id}/abort       stop the session's running turn, close the trajectory as aborted
  POST /v1/weights, /v1/pause, /v1/resume, /v1/abort   the trainer's control plane (admin.py; the admin key)
  GET  /v1/models, /health, /metrics

A session is named by the `X-Prorsa-Trajectory` header or the body's `trajectory_id` (an OpenAI client's
`extra_body`). Every refusal is a JSON error body in OpenAI's shape, counted by kind: malformed JSON or a field
Prorsa cannot honour (400, naming it), a missing or wrong API key (401), an unknown session (404), a finished or
busy session (409), a session open on the bus but not here (409 `session_lost`: the gateway restarted), a body
over `max_body_bytes` (413), too many turns at once or a saturated cluster (429 with Retry-After). Bodies are parsed
here (not by a framework's validator) so every error has that one shape.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prorsa.client.client import Trajectory
from prorsa.gateway import shapes, streaming
from prorsa.gateway.admin import Admin, AdminError
from prorsa.gateway.chat_template import TemplateError
from prorsa.gateway.sampling import Sampling, UnsupportedField, build_sampling
from prorsa.gateway.schemas import (
    SGLANG_SAMPLING,
    TRAJECTORY_ID_PATTERN,
    ChatRequest,
    CompletionRequest,
    FinishRequest,
    GenerateRequest,
)
from prorsa.gateway.sessions import Session
from prorsa.gateway.tool_parser import make_parser
from prorsa.gateway.turns import Gateway, PromptBuilder, Turn, TurnError
from proto import MAX_TOP_LOGPROBS

M = TypeVar("M", bound=BaseModel)
SESSION_HEADER = "x-prorsa-trajectory"
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.5  # how often a client waiting for a whole answer is checked for having gone away


@dataclass
class HttpConfig:
    api_key: str = ""  # "" = no key required
    admin_api_key: str = ""  # the admin endpoints' key ("" = the api_key, if any, serves them too)
    max_body_bytes: int = 32 * 1024 * 1024
    max_concurrent_turns: int = 4096  # turns running at once; more are refused with 429
    tool_parser: str = "hermes"


class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def build_app(gw: Gateway, http: HttpConfig) -> Starlette:
    """The Starlette app of one gateway process."""
    api = _Api(gw, http)
    routes = [
        Route("/v1/chat/completions", api.endpoint("chat", api.chat), methods=["POST"]),
        Route("/v1/completions", api.endpoint("completions", api.completions), methods=["POST"]),
        Route("/generate", api.endpoint("generate", api.generate), methods=["POST"]),
        Route("/v1/trajectories/{traj_id}/finish", api.endpoint("finish", api.finish), methods=["POST"]),
        Route("/v1/trajectories/{traj_id}/abort", api.endpoint("abort", api.abort), methods=["POST"]),
        Route("/v1/weights", api.endpoint("weights", api.admin.weights, admin=True), methods=["POST"]),
        Route("/v1/pause", api.endpoint("pause", api.admin.pause, admin=True), methods=["POST"]),
        Route("/v1/resume", api.endpoint("resume", api.admin.resume, admin=True), methods=["POST"]),
        Route("/v1/abort", api.endpoint("abort_older_than", api.admin.abort, admin=True), methods=["POST"]),
        Route("/v1/models", api.endpoint("models", api.models), methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_page, methods=["GET"]),
    ]
    return Starlette(routes=routes)


class _Api:
    def __init__(self, gw: Gateway, http: HttpConfig) -> None:
        self.gw = gw
        self.http = http
        self.metrics = gw.metrics
        self.running = 0
        # Raises ValueError for an unknown parser: the gateway does not start with one.
        self.parse_tools = make_parser(
            http.tool_parser, gw.tokenizer.tok if gw.tokenizer is not None else None
        )
        self._aborting: set[asyncio.Future] = set()  # aborts outliving their request, held till done
        self.admin = Admin(gw.client, self._parse)

    # --- the frame every endpoint runs in: auth, errors, counting ----------------------------------------------
    def endpoint(
        self, name: str, handler: Callable[[Request], Awaitable[Response]], admin: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                self._authorise(request, admin)
                response = await handler(request)
            except AdminError as exc:
                response = self._error(exc.status, exc.code, str(exc), None)
                body = json.loads(bytes(response.body))
                body["error"].update(engines=exc.engines, failed=exc.failed)
                response = JSONResponse(body, status_code=exc.status)
            except HttpError as exc:
                response = self._error(exc.status, exc.code, str(exc), exc.param)
            except TurnError as exc:
                response = self._error(exc.status, exc.code, str(exc), exc.param)
            except UnsupportedField as exc:
                response = self._error(400, "unsupported_field", str(exc), exc.field)
            except TemplateError as exc:
                response = self._error(400, "chat_template", str(exc), "messages")
            self.metrics.requests.labels(endpoint=name, code=str(response.status_code)).inc()
            return response

        return run

    def _error(self, status: int, code: str, message: str, param: str | None) -> JSONResponse:
        self.metrics.errors.labels(kind=code).inc()
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
        return JSONResponse(
            shapes.error_body(message, code, param, kind), status_code=status, headers=headers
        )

    def _authorise(self, request: Request, admin: bool = False) -> None:
        """The key an endpoint needs: the admin key for the control plane when one is set (the plain key then
        does not do), else the gateway's key; none when neither is set (an open gateway, warned at start)."""
        key = self.http.admin_api_key or self.http.api_key if admin else self.http.api_key
        if not key:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), key):
            what = "admin API key" if admin and self.http.admin_api_key else "API key"
            raise HttpError(401, "invalid_api_key", f"missing or wrong {what} (Authorization: Bearer KEY)")

    async def _parse(self, request: Request, model: type[M]) -> M:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.http.max_body_bytes:
            raise HttpError(413, "request_too_large", f"the body exceeds {self.http.max_body_bytes} bytes")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self.http.max_body_bytes:
                raise HttpError(
                    413, "request_too_large", f"the body exceeds {self.http.max_body_bytes} bytes"
                )
        try:
            data = json.loads(body) if body else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HttpError(400, "invalid_json", f"the body is not JSON: {exc}") from exc
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise HttpError(400, "invalid_field", f"{where}: {first['msg']}", where or None) from exc

    def _session_id(self, request: Request, body_value: str | None) -> str | None:
        header = request.headers.get(SESSION_HEADER)
        if header is not None and not re.match(TRAJECTORY_ID_PATTERN, header):
            raise HttpError(
                400, "invalid_field", f"{SESSION_HEADER}: 1-180 letters, digits, '_' or '-'", SESSION_HEADER
            )
        return header or body_value

    async def _turns(self, run: Callable[[], Awaitable[list[Turn]]], n: int) -> list[Turn]:
        if self.running + n > self.http.max_concurrent_turns:
            raise HttpError(429, "too_many_requests", f"{self.running} turns are running; retry shortly")
        self.running += n
        try:
            with self.metrics.turn_seconds.time():
                return await run()
        finally:
            self.running -= n

    async def _answer(
        self,
        request: Request,
        session_id: str | None,
        n: int,
        builder: PromptBuilder,
        sampling: Sampling,
        task: str,
        version: int,
    ) -> list[Turn]:
        """The turns of a whole (not streamed) answer: one, or a group of n; a client that goes away meanwhile
        (an agent's timeout) has them aborted on their engines rather than decoded for nobody."""
        started: list[Trajectory] = []
        if n > 1:
            if session_id is not None:
                raise HttpError(
                    400, "invalid_field", "n > 1 is a group of trajectories: not with a session", "n"
                )

            async def run() -> list[Turn]:
                return await self.gw.run_group(n, builder, sampling, task, version, on_start=started.append)

        else:

            async def run() -> list[Turn]:
                turn = await self.gw.run(
                    session_id, builder, sampling, task=task, policy_version=version, on_start=started.append
                )
                return [turn]

        turns = asyncio.ensure_future(self._turns(run, n))
        while True:
            done, _ = await asyncio.wait({turns}, timeout=DISCONNECT_POLL_S)
            if done:
                return turns.result()
            if await request.is_disconnected():
                self.metrics.aborts.labels(cause="disconnect").inc()
                await self.gw.abort_turn(started, turns)
                return await turns  # answered to nobody; raises what the turn raised

    def _tokenizer(self, what: str) -> Any:
        if self.gw.tokenizer is None:
            raise HttpError(
                400, "no_tokenizer", f"{what} needs a tokenizer: start the gateway with --tokenizer DIR"
            )
        return self.gw.tokenizer

    # --- endpoints ------------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        req = await self._parse(request, ChatRequest)
        tok = self._tokenizer("chat")
        if req.top_logprobs and not req.logprobs:
            raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs: true (as OpenAI's API)")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise UnsupportedField("response_format", "only response_format type 'text' is supported")
        if isinstance(req.tool_choice, dict) or req.tool_choice == "required":
            raise UnsupportedField(
                "tool_choice", "tool_choice 'auto' or 'none' only: a call cannot be forced"
            )
        sampling = build_sampling(req.model_dump(), self.gw.config.max_tokens_cap)
        session_id = self._session_id(request, req.trajectory_id)
        msgs = [m.template_message() for m in req.messages]
        tools = req.tools

        def build(s: Session) -> tuple[list[int], str]:
            plan = self.gw.sessions.plan_chat(s, msgs, tools)
            if plan.new_messages is None:
                return tok.first_prompt(msgs, tools), plan.prefix_break
            return s.context + tok.continuation(s.output, plan.new_messages, tools), ""

        builder = PromptBuilder(build, lambda s: {"messages": msgs, "tools": tools})
        parse = bool(tools) and req.tool_choice != "none"

        def message(turn: Turn) -> tuple[str | None, list]:
            return self.parse_tools(turn.text or "", tools or []) if parse else (turn.text, [])

        if req.stream:
            return await self._chat_stream(req, session_id, builder, sampling, message)
        turns = await self._answer(
            request, session_id, req.n, builder, sampling, req.task, req.policy_version
        )
        body = shapes.chat_response(
            self.gw.config.model_name, turns, [message(t) for t in turns], bool(req.logprobs), tok.decode
        )
        return JSONResponse(body)

    async def completions(self, request: Request) -> Response:
        req = await self._parse(request, CompletionRequest)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise UnsupportedField(
                "logprobs",
                f"logprobs={req.logprobs}: 0 (the sampled token's) to {MAX_TOP_LOGPROBS} alternatives",
            )
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise HttpError(400, "invalid_field", "one prompt per request (use n for a group)", "prompt")
            prompt = prompt[0]  # type: ignore[assignment]
        ids = self._tokenizer("a text prompt").encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise HttpError(400, "invalid_field", "the prompt is empty", "prompt")
        fields = req.model_dump() | {"top_logprobs": req.logprobs or 0}
        sampling = build_sampling(fields, self.gw.config.max_tokens_cap)
        session_id = self._session_id(request, req.trajectory_id)
        builder = self._ids_builder(ids)
        if req.stream:
            return await self._completion_stream(req, session_id, builder, sampling)
        turns = await self._answer(
            request, session_id, req.n, builder, sampling, req.task, req.policy_version
        )
        decode = self.gw.tokenizer.decode if self.gw.tokenizer is not None else None
        return JSONResponse(
            shapes.completion_response(self.gw.config.model_name, turns, req.logprobs is not None, decode)
        )

    def _ids_builder(self, ids: list[int]) -> PromptBuilder:
        def build(s: Session) -> tuple[list[int], str]:
            ok = self.gw.sessions.extends(s, ids)
            return ids, "" if ok else "the prompt does not extend the last turn's prompt + output"

        return PromptBuilder(build)

    async def generate(self, request: Request) -> Response:
        req = await self._parse(request, GenerateRequest)
        fields: dict[str, Any] = {}
        for key, value in req.sampling_params.items():
            if key not in SGLANG_SAMPLING:
                raise UnsupportedField(f"sampling_params.{key}", f"sampling_params.{key} is not supported")
            if SGLANG_SAMPLING[key] is not None:
                fields[SGLANG_SAMPLING[key]] = value
        if fields.get("n", 1) != 1:
            raise UnsupportedField("sampling_params.n", "/generate takes one sample; send n requests")
        if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise UnsupportedField("top_logprobs_num", f"top_logprobs_num: 0 to {MAX_TOP_LOGPROBS}")
        if req.top_logprobs_num and not req.return_logprob:
            raise UnsupportedField("top_logprobs_num", "top_logprobs_num needs return_logprob: true")
        fields["top_logprobs"] = req.top_logprobs_num
        if req.input_ids is not None:
            ids = list(req.input_ids)
        elif req.text is not None:
            ids = self._tokenizer("a text prompt").encode(req.text)
        else:
            raise HttpError(400, "invalid_field", "give input_ids or text", "input_ids")
        if not ids:
            raise HttpError(400, "invalid_field", "the prompt is empty", "input_ids")
        sampling = build_sampling(fields, self.gw.config.max_tokens_cap)
        session_id = self._session_id(request, req.trajectory_id)
        builder = self._ids_builder(ids)
        if req.stream:
            events = functools.partial(
                streaming.generate_events,
                hold_text=bool(sampling.stop),
                logprobs=req.return_logprob,
                decode=self.gw.tokenizer.decode if self.gw.tokenizer is not None else None,
            )
            return await self._stream(session_id, builder, sampling, req.task, req.policy_version, events)
        turns = await self._answer(request, session_id, 1, builder, sampling, req.task, req.policy_version)
        return JSONResponse(shapes.generate_response(turns[0], req.return_logprob))

    async def finish(self, request: Request) -> Response:
        req = await self._parse(request, FinishRequest)
        traj_id = request.path_params["traj_id"]
        turns = await self.gw.finish(traj_id, req.reward, req.status)
        return JSONResponse({"id": traj_id, "object": "trajectory", "status": req.status, "turns": turns})

    async def abort(self, request: Request) -> Response:
        traj_id = request.path_params["traj_id"]
        turns = await self.gw.abort(traj_id)
        return JSONResponse({"id": traj_id, "object": "trajectory", "status": "aborted", "turns": turns})

    async def models(self, request: Request) -> Response:
        name = self.gw.config.model_name
        card = {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "prorsa",
            "max_model_len": self.gw.config.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        ok = self.gw.client.nc.is_connected
        body = {
            "status": "ok" if ok else "degraded",
            "nats": ok,
            "sessions": len(self.gw.sessions),
            "turns": self.running,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics_page(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # --- streaming ------------------------------------------------------------------------------------------
    async def _chat_stream(
        self,
        req: ChatRequest,
        session_id: str | None,
        builder: PromptBuilder,
        sampling: Sampling,
        message: Callable[[Turn], tuple[str | None, list]],
    ) -> Response:
        if req.n != 1:
            raise UnsupportedField("n", "streaming answers one choice: n must be 1")
        events = functools.partial(
            streaming.chat_events,
            model=self.gw.config.model_name,
            # Text is streamed as it decodes unless it may still change: stop strings cut it and tool calls are
            # parsed from the whole output; then it comes in one delta at the end (ids and logprobs still stream).
            hold_text=bool(sampling.stop) or bool(req.tools and req.tool_choice != "none"),
            logprobs=bool(req.logprobs),
            include_usage=bool(req.stream_options and req.stream_options.get("include_usage")),
            decode=self.gw.tokenizer.decode if self.gw.tokenizer is not None else None,
            message=message,
        )
        return await self._stream(session_id, builder, sampling, req.task, req.policy_version, events)

    async def _completion_stream(
        self, req: CompletionRequest, session_id: str | None, builder: PromptBuilder, sampling: Sampling
    ) -> Response:
        if req.n != 1:
            raise UnsupportedField("n", "streaming answers one choice: n must be 1")
        events = functools.partial(
            streaming.completion_events,
            model=self.gw.config.model_name,
            hold_text=bool(sampling.stop),
            logprobs=req.logprobs is not None,
            decode=self.gw.tokenizer.decode if self.gw.tokenizer is not None else None,
        )
        return await self._stream(session_id, builder, sampling, req.task, req.policy_version, events)

    async def _stream(
        self,
        session_id: str | None,
        builder: PromptBuilder,
        sampling: Sampling,
        task_name: str,
        version: int,
        events: Callable[[asyncio.Queue, asyncio.Task], AsyncIterator[bytes]],
    ) -> Response:
        queue: asyncio.Queue = asyncio.Queue()
        streaming = asyncio.Event()
        started: list[Any] = []  # the turn's trajectory, once known (what a disconnect aborts)

        def on_chunk(chunk: Any) -> None:
            queue.put_nowait(chunk)
            streaming.set()

        async def run() -> list[Turn]:
            return [
                await self.gw.run(
                    session_id,
                    builder,
                    sampling,
                    task=task_name,
                    policy_version=version,
                    on_chunk=on_chunk,
                    on_start=started.append,
                )
            ]

        if self.running + 1 > self.http.max_concurrent_turns:
            raise HttpError(429, "too_many_requests", f"{self.running} turns are running; retry shortly")
        task = asyncio.create_task(self._turns(run, 1))
        # Headers wait for the first tokens (or the turn's end), so a turn refused before it streams (a busy or
        # finished session, a saturated cluster, a prompt past the window) is still an HTTP error status.
        first = asyncio.ensure_future(streaming.wait())
        await asyncio.wait({task, first}, return_when=asyncio.FIRST_COMPLETED)
        first.cancel()
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

        async def body() -> AsyncIterator[bytes]:
            try:
                async for data in events(queue, task):
                    yield data
            except (TurnError, HttpError) as exc:  # the turn failed after the stream began: say so in it
                yield shapes.sse(shapes.error_body(str(exc), exc.code, exc.param))
                yield shapes.sse("[DONE]")
            finally:
                if not task.done():  # the client went away mid-stream: stop the turn on its engine
                    self.metrics.aborts.labels(cause="disconnect").inc()
                    if started:
                        # Shielded: this generator is being closed; the abort must still reach the bus.
                        aborting = asyncio.ensure_future(self.gw.abort_turn(started, task))
                        self._aborting.add(aborting)
                        aborting.add_done_callback(self._aborting.discard)
                    else:
                        task.cancel()

        return StreamingResponse(body(), media_type="text/event-stream")

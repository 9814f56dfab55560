"""The gateway's turns, over the client SDK: a session is a `Trajectory`, a request one `generate`.

Each HTTP request becomes one turn (or n, for a group): the session is acquired (`sessions.py`), the prompt built
by the caller from it, the turn run with `Trajectory.generate` (so placement, affinity, retries and exactly-once
streams are the SDK's), stop strings applied, and the session told what the next turn must extend.

A gateway that restarts loses its sessions (their turns' ids live only here). A request naming a session this process
does not hold, but which the bus holds open (its turns are in the context log and it was not finished), is answered
409 `session_lost`, never continued from a guess and never started afresh under an id whose request ids the engines
have seen: the client starts a new session, and `/finish` or `/abort` of the lost one closes it on the bus.

The tool call is the gap between a session's turns: after a response goes out the gateway reports the tool call's
start, and when the session's next request arrives its end (with the observation's size: the prompt's new tokens),
so the tracker sees every agent's tool calls without the agent saying anything. A request with no session is a
trajectory of one turn, finished with its response.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import nats

from prorsa.client.client import ClusterSaturated, GenerateError, RolloutClient, Trajectory
from prorsa.client.surely import surely
from prorsa.gateway.chat_template import ChatTokenizer
from prorsa.gateway.metrics import GatewayMetrics
from prorsa.gateway.sampling import Sampling, cut_at_stop
from prorsa.gateway.sessions import Session, SessionError, SessionTable
from proto import TokenChunk
from services.runtime.logging import get_logger

log = get_logger("gateway", "")


def _lost(traj_id: str) -> str:
    return (
        f"session {traj_id!r} is open on the bus but not held by this gateway process (it restarted, or another "
        "gateway holds the session): its turns' token ids are not here, so it cannot go on token-exactly. Start a "
        f"new session (a new trajectory id); POST /v1/trajectories/{traj_id}/finish (with its reward) or /abort "
        "closes this one"
    )


# Sampling fields only an engine can check (its own logprobs kind and top-k limit).
_ENGINE_CHECKED = ("logprobs_mode", "top_logprobs")


class TurnError(Exception):
    """A turn that cannot run or failed; `status` is the HTTP status, `code` the OpenAI error code."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


@dataclass(frozen=True, slots=True)
class Turn:
    """One finished turn, as the endpoints answer it."""

    traj_id: str
    turn: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length" | "abort" (engine's, or "stop" on a stop string)
    text: str | None  # the output's text (None: no tokenizer)
    cached_tokens: int
    engine_id: str
    policy_version: int
    ttft_s: float
    # Per output token, its k most likely (token id, logprob), the most likely first (sampling.top_logprobs = k)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # The policy version that sampled each output id (aligned with output_ids).
    token_versions: tuple[int, ...] = ()


@dataclass
class GatewayConfig:
    model_name: str = "prorsa"
    max_model_len: int = 32768  # prompt + output tokens a turn may hold
    max_tokens_cap: int = 32768
    session_idle_s: float = 3600.0  # a session with no request this long is closed as aborted (wall seconds)


@dataclass
class PromptBuilder:
    """Builds a turn's prompt from its session: returns (prompt ids, prefix-break reason or "")."""

    build: Callable[[Session], tuple[list[int], str]]
    on_recorded: Callable[[Session], dict] = field(
        default=lambda s: {}
    )  # extra fields for `SessionTable.record`


class Gateway:
    def __init__(
        self,
        client: RolloutClient,
        tokenizer: ChatTokenizer | None,
        config: GatewayConfig,
        metrics: GatewayMetrics,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.sessions = SessionTable()
        self.trajectories: dict[str, Trajectory] = {}
        # session -> the task running its turn (what abort cancels)
        self.running: dict[str, asyncio.Task] = {}
        # session -> the publication of its tool call's start (off the response's path; awaited before its end)
        self._tool_started: dict[str, asyncio.Future] = {}
        self._aborting: set[asyncio.Future] = set()  # aborts on a stop string, held until published
        # trajectories with a turn running, by id (what a stopping gateway aborts)
        self.live: dict[str, Trajectory] = {}

    def decode(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else None

    async def run(
        self,
        session_id: str | None,
        builder: PromptBuilder,
        sampling: Sampling,
        *,
        task: str = "",
        policy_version: int = 0,
        group: str = "",
        on_chunk: Callable[[TokenChunk], None] | None = None,
        on_start: Callable[[Trajectory], None] | None = None,
    ) -> Turn:
        """One turn of `session_id` (None: a one-turn trajectory); `on_start` is told its trajectory before the
        turn is sent (so a caller can abort it). Raises TurnError."""
        if session_id is None:
            return await self._one_shot(builder, sampling, task, policy_version, group, on_chunk, on_start)
        try:
            s, fresh = self.sessions.acquire(session_id, time.monotonic())
        except SessionError as exc:
            raise TurnError(exc.status, exc.code, str(exc)) from exc
        self.metrics.sessions.set(len(self.sessions))
        current = asyncio.current_task()
        if current is not None:
            self.running[session_id] = current
        try:
            if fresh:
                if await self._open_on_bus(session_id):
                    self.sessions.forget(session_id)
                    raise TurnError(409, "session_lost", _lost(session_id))
                self.trajectories[session_id] = await self.client.start_trajectory(
                    session_id, task=task, policy_version=policy_version, group=group
                )
            traj = self.trajectories[session_id]
            if on_start is not None:
                on_start(traj)
            prompt_ids, broke = builder.build(s)
            self._check_prefix(s, broke)
            self._check_window(prompt_ids, sampling)
            if s.turns:  # the tool call (the gap since the last response) ends now
                gap = self._tool_started.pop(session_id, None)
                if gap is not None:
                    await gap  # its start is on the bus before its end
                await traj.tool_finished("", observation_tokens=max(0, len(prompt_ids) - len(s.context)))
            turn = await self._generate(traj, prompt_ids, sampling, on_chunk)
            self.sessions.record(s, prompt_ids, turn.output_ids, time.monotonic(), **builder.on_recorded(s))
            # The tool call starts now, until this session's next request; published off the response's path.
            self._tool_started[session_id] = asyncio.ensure_future(traj.tool_started(""))
            return turn
        finally:
            self.running.pop(session_id, None)
            self.sessions.release(s)

    async def _one_shot(
        self,
        builder: PromptBuilder,
        sampling: Sampling,
        task: str,
        policy_version: int,
        group: str,
        on_chunk: Callable[[TokenChunk], None] | None,
        on_start: Callable[[Trajectory], None] | None = None,
    ) -> Turn:
        prompt_ids, _ = builder.build(Session("", 0.0))
        self._check_window(prompt_ids, sampling)
        traj = await self.client.start_trajectory(
            f"gw-{uuid.uuid4().hex[:16]}", task=task, policy_version=policy_version, group=group
        )
        if on_start is not None:
            on_start(traj)
        try:
            turn = await self._generate(traj, prompt_ids, sampling, on_chunk)
        except BaseException:  # refused, failed or cancelled: the tracker must not count it as finished
            await surely(traj.finish(status="aborted"))  # through every cancellation (prorsa.client.surely)
            raise
        await traj.finish()
        return turn

    async def _generate(
        self,
        traj: Trajectory,
        prompt_ids: list[int],
        sampling: Sampling,
        on_chunk: Callable[[TokenChunk], None] | None,
    ) -> Turn:
        turn = traj.turn
        watch = on_chunk
        if sampling.stop and self.tokenizer is not None:
            watch = self._stop_watch(traj, sampling, self.tokenizer, on_chunk)
        self.metrics.in_flight.inc()
        self.live[traj.traj_id] = traj
        try:
            result = await traj.generate(prompt_ids, sampling.params, on_chunk=watch)
        except GenerateError as exc:
            # An engine's refusal of a sampling field starts with the field's name (the backends'
            # `sampling_problem`): name it as the refusals made here do.
            param = next((f for f in _ENGINE_CHECKED if str(exc).startswith(f)), None)
            raise TurnError(400, "invalid_request", f"the engine refused the turn: {exc}", param) from exc
        except ClusterSaturated as exc:
            raise TurnError(429, "overloaded", str(exc)) from exc
        except TimeoutError as exc:
            raise TurnError(504, "timeout", str(exc)) from exc
        finally:
            self.live.pop(traj.traj_id, None)
            self.metrics.in_flight.dec()
        ids, logprobs, reason = list(result.token_ids), result.logprobs, result.finish_reason
        top = result.top_logprobs
        text = self.decode(ids)
        if sampling.stop and self.tokenizer is not None:
            cut = cut_at_stop(ids, sampling.stop, self.tokenizer.decode, sampling.params.min_tokens)
            if cut is not None:
                keep, text = cut
                ids, reason = ids[:keep], "stop"
                logprobs = logprobs[:keep] if logprobs is not None else None
                top = top[:keep] if top is not None else None
                # The turn's output is what the caller keeps: the next prompt extends that, not the tokens the
                # engine sampled past the stop string (so the SDK's prefix check agrees with the session's).
                traj.last_context = [*prompt_ids, *ids]
        return Turn(
            traj.traj_id,
            turn,
            list(prompt_ids),
            ids,
            logprobs,
            reason,
            text,
            result.cached_tokens,
            result.engine_id,
            result.policy_version,
            result.ttft_s,
            top,
            tuple(result.token_versions[: len(ids)]),
        )

    def _stop_watch(
        self,
        traj: Trajectory,
        sampling: Sampling,
        tokenizer: ChatTokenizer,
        on_chunk: Callable[[TokenChunk], None] | None,
    ) -> Callable[[TokenChunk], None]:
        """A chunk callback that aborts the turn on its engine once the output holds a stop string, so the engine
        does not decode on to max_tokens for text that will be cut (`_generate` cuts at the stop either way)."""
        ids: list[int] = []
        # Only the tail can complete a stop string that was not there before: decode the new ids and enough
        # before them to hold the longest stop string (a token is at least one character but for ids outside the
        # vocabulary, hence the margin), so a long output costs one short decode per chunk, not a whole one.
        # A stop string missed here (all of it inside out-of-vocabulary ids) only delays the abort: the cut in
        # `_generate` reads the whole output.
        stops, min_tokens = sampling.stop, sampling.params.min_tokens
        margin = 4 * max(len(s) for s in stops) + 8
        aborted = False

        def watch(chunk: TokenChunk) -> None:
            nonlocal aborted
            if on_chunk is not None:
                on_chunk(chunk)
            if aborted:
                return
            ids.extend(chunk.token_ids)
            tail = tokenizer.decode(ids[-(len(chunk.token_ids) + margin) :])
            # With min_tokens, a stop string in the tail may lie within the first min_tokens tokens, where it does
            # not count: the whole cut decides then (rarely: only once the tail holds one).
            if any(s in tail for s in stops) and (
                min_tokens == 0 or cut_at_stop(ids, stops, tokenizer.decode, min_tokens) is not None
            ):
                aborted = True
                self.metrics.aborts.labels(cause="stop").inc()
                task = asyncio.ensure_future(traj.abort("stop string"))
                self._aborting.add(task)
                task.add_done_callback(self._aborting.discard)

        return watch

    async def run_group(
        self,
        n: int,
        builder: PromptBuilder,
        sampling: Sampling,
        task: str = "",
        policy_version: int = 0,
        on_start: Callable[[Trajectory], None] | None = None,
    ) -> list[Turn]:
        """n one-turn trajectories on one prompt: a GRPO group (`TrajectoryStarted.group`); `on_start` is told
        each trajectory before its turn is sent. Raises TurnError."""
        group = f"g-{uuid.uuid4().hex[:12]}"
        # One engine for the whole group, so the shared prompt is prefilled and cached there once.
        engine = self.client.directory.group_target(time.monotonic()) or ""

        def place(traj: Trajectory) -> None:
            traj.affinity_engine = engine
            if on_start is not None:
                on_start(traj)

        runs = [self._one_shot(builder, sampling, task, policy_version, group, None, place) for _ in range(n)]
        return list(await asyncio.gather(*runs))

    def _check_prefix(self, s: Session, reason: str) -> None:
        if not reason:
            return
        self.metrics.prefix_breaks.inc()
        if not s.broken:  # once per trajectory: a client that always re-templates would flood the log
            s.broken = True
            log.warning("prefix_break", traj_id=s.traj_id, turn=s.turns, reason=reason)

    def _check_window(self, prompt_ids: list[int], sampling: Sampling) -> None:
        need = len(prompt_ids) + sampling.params.max_tokens
        if len(prompt_ids) >= self.config.max_model_len:
            raise TurnError(
                400,
                "context_length_exceeded",
                f"the prompt has {len(prompt_ids)} tokens; the model's window is {self.config.max_model_len}",
                "messages",
            )
        if need > self.config.max_model_len:
            raise TurnError(
                400,
                "context_length_exceeded",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.params.max_tokens}) exceeds the "
                f"model's window of {self.config.max_model_len} tokens",
                "max_tokens",
            )

    async def _open_on_bus(self, traj_id: str) -> bool:
        """Whether `traj_id`, unknown here, is a trajectory open on the bus (see the module doc). Raises TurnError
        503 when the bus cannot say."""
        try:
            return await self.client.context_log.holds(traj_id)
        except (nats.errors.Error, TimeoutError) as exc:
            raise TurnError(
                503, "bus_unavailable", f"cannot look up session {traj_id!r} on the bus: {exc!r}"
            ) from exc

    async def _close_lost(self, traj_id: str, reward: float | None, status: str) -> bool:
        """Close on the bus a session open there but not here (see the module doc); False: the bus does not hold
        it either."""
        if not await self._open_on_bus(traj_id):
            return False
        await self.client.close_trajectory(traj_id, reward=reward, status=status)
        self.sessions.closed(traj_id)
        log.info("lost_session_closed", traj_id=traj_id, status=status)
        return True

    async def finish(self, traj_id: str, reward: float | None, status: str) -> int | None:
        """Close a session as the SDK's `finish` does; returns its turns (None: a session opened before a restart
        or by another gateway, closed on the bus, its turns counted by the tracker). Raises TurnError (404
        unknown, 409 finished or busy)."""
        try:
            s = self.sessions.get(traj_id)
            if s.busy:
                raise SessionError(
                    409, "session_busy", f"session {traj_id!r} has a turn running: abort it first"
                )
            self.sessions.finish(traj_id)
        except SessionError as exc:
            if exc.status == 404 and await self._close_lost(traj_id, reward, status):
                return None
            raise TurnError(exc.status, exc.code, str(exc)) from exc
        traj = self.trajectories.pop(traj_id)
        gap = self._tool_started.pop(traj_id, None)
        if gap is not None:
            await gap
        await traj.finish(reward=reward, status=status)  # type: ignore[arg-type]
        self.metrics.sessions.set(len(self.sessions))
        return s.turns

    async def abort_all(self) -> int:
        """A stopping gateway's last word: abort every running turn on its engine (answered "abort" to the clients
        still connected), so no engine decodes on for a client nobody will answer. Returns how many."""
        live = list(self.live.values())
        for traj in live:
            await traj.abort("gateway stopping")
        return len(live)

    async def close_idle(self, now: float) -> list[str]:
        """Close, as aborted, every session idle past `config.session_idle_s` (an agent that never came back):
        the tracker stops counting it as in a tool call, and its memory goes."""
        closed = []
        for traj_id in self.sessions.idle(now, self.config.session_idle_s):
            try:
                await self.finish(traj_id, None, "aborted")
            except TurnError:  # a turn started or it was finished meanwhile: not idle after all
                continue
            log.info("session_idle_closed", traj_id=traj_id)
            closed.append(traj_id)
        return closed

    async def abort(self, traj_id: str) -> int | None:
        """Stop the session's running turn, if any, and close its trajectory as aborted; returns its turns (None: a
        lost session, as `finish`). Raises TurnError (404 unknown, 409 finished)."""
        try:
            self.sessions.get(traj_id)
        except SessionError as exc:
            if exc.status == 404 and await self._close_lost(traj_id, None, "aborted"):
                return None
            raise TurnError(exc.status, exc.code, str(exc)) from exc
        task = self.running.get(traj_id)
        if task is not None and not task.done():
            self.metrics.aborts.labels(cause="request").inc()
            await self.abort_turn([self.trajectories[traj_id]], task)
        return await self.finish(traj_id, None, "aborted")

    async def abort_turn(self, trajs: list[Trajectory], task: asyncio.Future, wait_s: float = 10.0) -> None:
        """Abort the running turns of `trajs` on the bus (each engine stops its turn and answers "abort") and wait
        for `task`, the turns', to end; cancelled only if no answer comes in `wait_s` (no engine holds it or will)."""
        for traj in trajs:
            await traj.abort("gateway")
        _, pending = await asyncio.wait({task}, timeout=wait_s)
        if pending:
            task.cancel()
            await asyncio.wait({task})

"""Sessions of the gateway: one session = one trajectory, its turns' ids, and whether each new turn extends the last.

Pure (no I/O, no clock: `now` is passed in). The gateway's only state; a session the gateway does not know starts a
new trajectory (`acquire`) unless the caller finds it open on the bus (opened before a restart, or by another
gateway: its state is not here, so it is `forget`-ten and refused), a finished one is refused (its id is remembered,
not its state: the last `max_finished`), and two requests of one session at once are refused (their turns would
share a request id). A session idle for long (`idle`: an agent that never came back) is for the caller to close.

Prefix rule (DESIGN.md principle 9): turn k+1's prompt must extend turn k's prompt + output. A chat request
extends it when it repeats the messages of turn k's request unchanged, then turn k's assistant message, then new
messages (`plan_chat`); a token-id request when its prompt starts with those ids (`extends`). Anything else is a
prefix break: counted, logged once per trajectory by the caller, and the prompt is rendered from scratch.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field


class SessionError(ValueError):
    """A request the session cannot take; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class Session:
    traj_id: str
    opened_s: float
    turns: int = 0
    messages: int = 0  # messages of turn k's chat request (the assistant reply is message `messages`)
    digest: str = ""  # of those messages
    tools_digest: str = ""
    context: list[int] = field(default_factory=list)  # turn k's prompt + output ids
    output: list[int] = field(default_factory=list)  # turn k's output ids
    busy: bool = False
    finished: bool = False
    broken: bool = False  # a prefix break was seen (logged once)
    last_reply_s: float | None = None  # when turn k's response went out: the tool call's start


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """How to build a chat turn's prompt: `new_messages` after the last turn (None: render all from scratch)."""

    new_messages: list[dict] | None
    prefix_break: str = ""  # why the history did not extend the last turn ("" = it did, or a first turn)


def digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class SessionTable:
    def __init__(self, max_sessions: int = 100_000, max_finished: int = 1_000_000) -> None:
        self.sessions: dict[str, Session] = {}
        self.max_sessions = max_sessions
        self.finished: OrderedDict[str, None] = OrderedDict()  # ids of finished sessions, oldest first
        self.max_finished = max_finished

    def __len__(self) -> int:
        return len(self.sessions)

    def get(self, traj_id: str) -> Session:
        """Raises SessionError(404) for an unknown session."""
        s = self.sessions.get(traj_id)
        if s is None:
            if traj_id in self.finished:
                raise SessionError(409, "session_finished", f"session {traj_id!r} is finished")
            raise SessionError(404, "unknown_session", f"no session {traj_id!r} on this gateway")
        return s

    def acquire(self, traj_id: str, now: float) -> tuple[Session, bool]:
        """The session for a new turn, marked busy, and whether it is new. Raises SessionError: finished (409),
        a turn already running (409), too many sessions (429)."""
        if traj_id in self.finished:
            raise SessionError(409, "session_finished", f"session {traj_id!r} is finished")
        s = self.sessions.get(traj_id)
        fresh = s is None
        if s is None:
            if len(self.sessions) >= self.max_sessions:
                raise SessionError(429, "too_many_sessions", f"{self.max_sessions} sessions are open")
            s = self.sessions[traj_id] = Session(traj_id, now)
        if s.busy:
            raise SessionError(
                409, "session_busy", f"session {traj_id!r} already has a turn running: send turns in order"
            )
        s.busy = True
        return s, fresh

    def release(self, s: Session) -> None:
        s.busy = False

    def plan_chat(self, s: Session, messages: list[dict], tools: list[dict] | None) -> ChatPlan:
        """See the module doc. `messages` are normalised dicts (no None fields)."""
        if s.turns == 0:
            return ChatPlan(None)
        n = s.messages
        if digest(tools or []) != s.tools_digest:
            return ChatPlan(None, "the tools changed")
        if len(messages) <= n + 1:
            return ChatPlan(None, f"{len(messages)} messages do not extend the last turn's {n} + its reply")
        if digest(messages[:n]) != s.digest:
            return ChatPlan(None, "earlier messages were changed")
        if messages[n].get("role") != "assistant":
            return ChatPlan(None, f"message {n} should be the last turn's assistant reply")
        return ChatPlan(messages[n + 1 :])

    def extends(self, s: Session, prompt_ids: list[int]) -> bool:
        """Whether `prompt_ids` extends turn k's prompt + output (a first turn always does)."""
        return s.turns == 0 or prompt_ids[: len(s.context)] == s.context

    def record(
        self,
        s: Session,
        prompt_ids: list[int],
        output_ids: list[int],
        now: float,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
    ) -> None:
        """Turn k done: remember what turn k+1 must extend."""
        s.turns += 1
        s.context = [*prompt_ids, *output_ids]
        s.output = list(output_ids)
        s.last_reply_s = now
        if messages is not None:
            s.messages = len(messages)
            s.digest = digest(messages)
            s.tools_digest = digest(tools or [])

    def finish(self, traj_id: str) -> Session:
        """Close it: its state goes, its id stays (so a late turn is refused). Raises SessionError 404/409."""
        s = self.get(traj_id)
        s.finished = True
        del self.sessions[traj_id]
        self.finished[traj_id] = None
        while len(self.finished) > self.max_finished:
            self.finished.popitem(last=False)
        return s

    def forget(self, traj_id: str) -> None:
        """Drop a session `acquire` just opened that cannot go on here (the caller found it open on the bus)."""
        self.sessions.pop(traj_id, None)

    def closed(self, traj_id: str) -> None:
        """Remember as finished a session this table never held (one closed on the bus for another gateway)."""
        self.finished[traj_id] = None
        while len(self.finished) > self.max_finished:
            self.finished.popitem(last=False)

    def idle(self, now: float, idle_s: float) -> list[str]:
        """Sessions with no turn running and none for `idle_s` (since their last response, or their opening)."""
        return [
            s.traj_id
            for s in self.sessions.values()
            if not s.busy and now - (s.last_reply_s if s.last_reply_s is not None else s.opened_s) > idle_s
        ]

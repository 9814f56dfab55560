"""The trajectory state machine as data: `TRANSITIONS[state][event kind] -> new state`.

States (proto.TRAJECTORY_STATES):
  queued     started, first turn not yet submitted
  prefill    a turn was submitted; waiting for or running its prefill (also: a failed request awaiting retry)
  decode     the turn's prefill is done; tokens are being generated
  tool_call  between model turns: the turn's output is done (RequestFinished) or a tool started, and the next turn
             is not submitted yet. The state is entered once per gap, so `time in state` is the time since the
             trajectory left the model, which is what a forecaster of the next turn's arrival needs.
  finished / aborted / lost  terminal; a terminal trajectory is folded into aggregates and leaves the live map.

Rules of operation (the core applies them before looking at the table):
  - Events name a turn. An event for an older turn than the trajectory's is stale (ignored, counted). An event for a
    newer turn means the turn was submitted and its `TurnSubmitted` is late or lost: the trajectory first advances
    to that turn in `prefill`, then the table is applied. So `RequestFinished` before `PrefillDone` and
    `TokenProgress` after `RequestFinished` are harmless: the table never moves a trajectory back within a turn.
  - A pair missing from the table is an impossible transition (a client or engine bug): it raises
    `TransitionError`, which the core turns into a counted rejection; the trajectory is left unchanged.

Event kinds are strings (one per message type; `TrajectoryFinished` splits by status).
"""

from __future__ import annotations

from typing import Final

QUEUED: Final = "queued"
PREFILL: Final = "prefill"
DECODE: Final = "decode"
TOOL_CALL: Final = "tool_call"
FINISHED: Final = "finished"
ABORTED: Final = "aborted"
LOST: Final = "lost"

LIVE_STATES: Final[tuple[str, ...]] = (QUEUED, PREFILL, DECODE, TOOL_CALL)
TERMINAL_STATES: Final[tuple[str, ...]] = (FINISHED, ABORTED, LOST)

STARTED: Final = "trajectory_started"
TURN_SUBMITTED: Final = "turn_submitted"
TOOL_STARTED: Final = "tool_call_started"
TOOL_FINISHED: Final = "tool_call_finished"
TRAJ_FINISHED: Final = "trajectory_finished"
TRAJ_ABORTED: Final = "trajectory_aborted"
PREFILL_DONE: Final = "prefill_done"
TOKEN_PROGRESS: Final = "token_progress"
REQUEST_FINISHED: Final = "request_finished"
REQUEST_FAILED: Final = "request_failed"

EVENT_KINDS: Final[tuple[str, ...]] = (
    STARTED,
    TURN_SUBMITTED,
    TOOL_STARTED,
    TOOL_FINISHED,
    TRAJ_FINISHED,
    TRAJ_ABORTED,
    PREFILL_DONE,
    TOKEN_PROGRESS,
    REQUEST_FINISHED,
    REQUEST_FAILED,
)

# Kinds that carry a turn number (all but the trajectory-level events).
TURN_EVENTS: Final[frozenset[str]] = frozenset(EVENT_KINDS) - {STARTED, TRAJ_FINISHED, TRAJ_ABORTED}

_ENDINGS: Final[dict[str, str]] = {TRAJ_FINISHED: FINISHED, TRAJ_ABORTED: ABORTED}

TRANSITIONS: Final[dict[str, dict[str, str]]] = {
    QUEUED: {
        STARTED: QUEUED,  # duplicate without a sequence number
        TURN_SUBMITTED: PREFILL,
        PREFILL_DONE: DECODE,  # TurnSubmitted late: the engine already prefilled turn 0
        TOKEN_PROGRESS: DECODE,
        REQUEST_FINISHED: TOOL_CALL,
        REQUEST_FAILED: PREFILL,
        # No tool events: a tool cannot run before the first model turn.
        **_ENDINGS,
    },
    PREFILL: {
        STARTED: PREFILL,  # late TrajectoryStarted: fills in the task
        TURN_SUBMITTED: PREFILL,
        PREFILL_DONE: DECODE,
        TOKEN_PROGRESS: DECODE,
        REQUEST_FINISHED: TOOL_CALL,  # engine events of one turn from two engines may swap
        REQUEST_FAILED: PREFILL,
        TOOL_STARTED: TOOL_CALL,  # the client saw the output before the engine's events arrived
        TOOL_FINISHED: TOOL_CALL,
        **_ENDINGS,
    },
    DECODE: {
        STARTED: DECODE,
        TURN_SUBMITTED: DECODE,  # late TurnSubmitted of the current turn
        PREFILL_DONE: DECODE,
        TOKEN_PROGRESS: DECODE,
        REQUEST_FINISHED: TOOL_CALL,
        REQUEST_FAILED: PREFILL,  # the client retries (or aborts the trajectory)
        TOOL_STARTED: TOOL_CALL,
        TOOL_FINISHED: TOOL_CALL,
        **_ENDINGS,
    },
    TOOL_CALL: {
        STARTED: TOOL_CALL,
        TURN_SUBMITTED: TOOL_CALL,  # late TurnSubmitted of the turn that just ended
        PREFILL_DONE: TOOL_CALL,  # late engine events of the ended turn never move it back
        TOKEN_PROGRESS: TOOL_CALL,
        REQUEST_FINISHED: TOOL_CALL,
        TOOL_STARTED: TOOL_CALL,
        TOOL_FINISHED: TOOL_CALL,
        # No REQUEST_FAILED: a request cannot fail after its output was complete.
        **_ENDINGS,
    },
}


class TransitionError(ValueError):
    """An (state, event kind) pair the table does not allow."""

    def __init__(self, state: str, kind: str) -> None:
        self.state = state
        self.kind = kind
        super().__init__(f"impossible transition: event {kind!r} in state {state!r}")


def next_state(state: str, kind: str) -> str:
    """The state after `kind` in `state`. Raises TransitionError for a pair the table does not hold."""
    try:
        return TRANSITIONS[state][kind]
    except KeyError:
        raise TransitionError(state, kind) from None

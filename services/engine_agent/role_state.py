"""The role-switch protocol of one engine, as a pure state machine (no I/O, no clock: `now` is a parameter).

An allocator moves engines between roles with `RoleSwitchCommand`s that carry an epoch. Commands may arrive late,
twice, or out of order (an allocator that restarted, a retried request, a reordered subject), so the engine fences
them by epoch. The rules, applied by `on_command` in this order:

1. A command naming another engine, or an epoch below 1 or a role outside `proto.ROLES` (impossible after a proto
   decode, guarded anyway), is rejected: the caller answers an ErrorReply; nothing changes. So is an epoch more
   than `max_epoch_jump` above the newest accepted (`epoch_jump`): epochs count commands one at a time, and one
   absurd epoch accepted would fence out every later command of the real allocator.
2. A command older than the newest epoch accepted (`newest_epoch`) is stale: it is answered with
   `RoleSwitchAck(ok=False, error="stale_command: ...")`; nothing changes.
3. A command repeating the newest epoch is a duplicate: nothing changes. If that switch is complete, the answer is
   the very same ack as before (`replay`); if it is running or queued, the caller answers when it completes (`wait`).
4. A newer epoch is accepted. With no switch running it starts now (`start`: phase `draining`). With one running it
   is queued (`queued`) and starts when the running one completes; a command still queued when an even newer one
   arrives is superseded and answered `ok=False` at once.
5. `on_switch_done` completes the running switch: the role becomes its target, `applied_epoch` its epoch, the ack
   is kept for replays, and the queued command (if any) starts. `on_switch_failed` completes it without changing
   the role (ack ok=False); the epoch is consumed all the same.

A command for the role the engine already has still runs as a switch (a fence bump) with nothing to move.
Phases: `serving` → (`start`) `draining` → (`on_switch_done`) `serving` in the new role ("switched"). The phase is
named for the switch of old (`draining`); what a switch does to held work is `switch_rule.py`'s (in place, nothing
drains).
Invariants (property-tested): `applied_epoch <= newest_epoch`, both only increase, and stale or duplicate commands
leave the state unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from proto import ROLES, RoleSwitchAck, RoleSwitchCommand

Phase = Literal["serving", "draining"]
DecisionKind = Literal["start", "queued", "wait", "replay", "stale", "rejected"]
# The allocator numbers commands cluster-wide, so a fresh engine's first epoch may be large; 2^32 commands is more
# than any deployment issues, and far below proto.MAX_COUNTER (2^53 - 1).
DEFAULT_MAX_EPOCH_JUMP = 2**32


class RoleStateError(RuntimeError):
    """The caller broke the protocol (our bug), e.g. completing a switch that is not running."""


@dataclass(frozen=True, slots=True)
class RoleState:
    engine_id: str
    role: str
    applied_epoch: int = 0  # epoch of the last completed switch (0: the role given at start-up)
    newest_epoch: int = 0  # highest epoch accepted (running, queued or applied)
    phase: Phase = "serving"
    active: RoleSwitchCommand | None = None  # the switch running now
    active_since_s: float = 0.0
    queued: RoleSwitchCommand | None = None  # accepted while `active` runs; starts after it
    last_ack: RoleSwitchAck | None = None  # ack of `applied_epoch`, replayed to duplicates
    max_epoch_jump: int = DEFAULT_MAX_EPOCH_JUMP  # rule 1: how far one command may move `newest_epoch`

    @property
    def switching(self) -> bool:
        return self.phase == "draining"


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do with one command. Exactly one of the optional fields is set, according to `kind`:
    start → `start`; replay/stale → `ack` (answer now); rejected → `error`; queued/wait → none (answer later);
    `superseded` may accompany `queued`."""

    kind: DecisionKind
    ack: RoleSwitchAck | None = None
    start: RoleSwitchCommand | None = None
    error: str = ""  # rejected: why
    error_kind: str = ""  # rejected: ErrorReply kind ("wrong_engine" | "invalid_command" | "epoch_jump")
    superseded: RoleSwitchAck | None = None  # answer for a queued command this one replaced


def initial_state(engine_id: str, role: str, max_epoch_jump: int = DEFAULT_MAX_EPOCH_JUMP) -> RoleState:
    """The state of an engine that starts in `role`. Raises ValueError for an unknown role or a bound below 1."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    if max_epoch_jump < 1:
        raise ValueError(f"max_epoch_jump must be >= 1, not {max_epoch_jump}")
    return RoleState(engine_id=engine_id, role=role, max_epoch_jump=max_epoch_jump)


def on_command(state: RoleState, cmd: RoleSwitchCommand, now: float) -> tuple[RoleState, Decision]:
    """Apply rules 1-4 to one command received at `now`; returns the new state and the decision."""
    if cmd.engine_id != state.engine_id:
        return state, Decision(
            "rejected",
            error=f"command for engine {cmd.engine_id!r} sent to engine {state.engine_id!r}",
            error_kind="wrong_engine",
        )
    if cmd.role not in ROLES or cmd.epoch < 1:
        return state, Decision(
            "rejected",
            error=f"invalid command: role {cmd.role!r}, epoch {cmd.epoch}",
            error_kind="invalid_command",
        )
    if cmd.epoch > state.newest_epoch + state.max_epoch_jump:
        return state, Decision(
            "rejected",
            error=f"epoch {cmd.epoch} jumps more than {state.max_epoch_jump} past the newest epoch "
            f"{state.newest_epoch}",
            error_kind="epoch_jump",
        )
    if cmd.epoch < state.newest_epoch:
        return state, Decision("stale", ack=_stale_ack(state, cmd, now))
    if cmd.epoch == state.newest_epoch:
        if state.last_ack is not None and state.last_ack.epoch == cmd.epoch:
            return state, Decision("replay", ack=state.last_ack)
        return state, Decision("wait")
    if state.active is None:
        started = replace(state, newest_epoch=cmd.epoch, phase="draining", active=cmd, active_since_s=now)
        return started, Decision("start", start=cmd)
    superseded = None
    if state.queued is not None:
        superseded = RoleSwitchAck(
            engine_id=state.engine_id,
            epoch=state.queued.epoch,
            role=state.role,  # type: ignore[arg-type]
            ok=False,
            error=f"superseded by epoch {cmd.epoch} before it started",
            ts_s=now,
        )
    return replace(state, newest_epoch=cmd.epoch, queued=cmd), Decision("queued", superseded=superseded)


def on_switch_done(
    state: RoleState, now: float, migrated: int = 0, drained: int = 0
) -> tuple[RoleState, RoleSwitchAck, RoleSwitchCommand | None]:
    """Complete the running switch (rule 5). Returns the new state, the ack for the completed epoch, and the
    queued command that starts now (or None). Raises RoleStateError if no switch is running."""
    cmd = state.active
    if cmd is None:
        raise RoleStateError(f"engine {state.engine_id}: no role switch is running (phase {state.phase})")
    ack = RoleSwitchAck(
        engine_id=state.engine_id,
        epoch=cmd.epoch,
        role=cmd.role,
        ok=True,
        switch_s=max(0.0, now - state.active_since_s),
        migrated_requests=migrated,
        drained_requests=drained,
        ts_s=now,
    )
    nxt = state.queued
    new = replace(
        state,
        role=cmd.role,
        applied_epoch=cmd.epoch,
        last_ack=ack,
        active=nxt,
        queued=None,
        phase="draining" if nxt is not None else "serving",
        active_since_s=now if nxt is not None else 0.0,
    )
    return new, ack, nxt


def on_switch_failed(
    state: RoleState, now: float, error: str
) -> tuple[RoleState, RoleSwitchAck, RoleSwitchCommand | None]:
    """The running switch could not complete (the backend refused the new role): the role stays, the epoch is
    consumed (a repeat gets the same failed ack), and the queued command starts. Raises RoleStateError as above."""
    cmd = state.active
    if cmd is None:
        raise RoleStateError(f"engine {state.engine_id}: no role switch is running (phase {state.phase})")
    ack = RoleSwitchAck(
        engine_id=state.engine_id,
        epoch=cmd.epoch,
        role=state.role,  # type: ignore[arg-type]
        ok=False,
        error=f"switch to {cmd.role} failed: {error}",
        switch_s=max(0.0, now - state.active_since_s),
        ts_s=now,
    )
    nxt = state.queued
    new = replace(
        state,
        applied_epoch=cmd.epoch,
        last_ack=ack,
        active=nxt,
        queued=None,
        phase="draining" if nxt is not None else "serving",
        active_since_s=now if nxt is not None else 0.0,
    )
    return new, ack, nxt


def _stale_ack(state: RoleState, cmd: RoleSwitchCommand, now: float) -> RoleSwitchAck:
    return RoleSwitchAck(
        engine_id=state.engine_id,
        epoch=cmd.epoch,
        role=state.role,  # type: ignore[arg-type]
        ok=False,
        error=f"stale_command: epoch {cmd.epoch} is older than epoch {state.newest_epoch}",
        ts_s=now,
    )

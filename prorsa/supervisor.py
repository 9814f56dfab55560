"""When to restart a child process that died: the restart policy of `prorsa up`, as a pure state machine.

Pure (no I/O, no clock): the caller reports `started(key, now)` and `exited(key, rc, now)`, and asks `due(now)` for
the children to start again. The rules, in the manner of Erlang/OTP supervisors and systemd's `Restart=always`:

- Every exit is answered by a restart of the same child (same arguments: an engine keeps its engine id, so the
  work addressed to it and its durable consumers find it again). A clean exit (rc 0) is restarted too: under
  `prorsa up` a child never has a reason to leave before the cluster stops.
- The delay doubles with each exit that follows a short run (`base_backoff_s`, 2×, 4×, … up to `max_backoff_s`)
  and falls back to `base_backoff_s` after a child ran for `stable_after_s`: a child killed once comes back at
  once, a child that cannot start does not spin.
- `loop_exits` exits within `loop_window_s` make the child *crash-looping*: it is still restarted (at the capped
  delay), and the state is reported by every `Exit` until the child has run stably again. Never hidden.
- One child's death never affects another child.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Exit:
    """What the supervisor decided about one exit (for the caller to print)."""

    key: str
    returncode: int
    restarts: int  # restarts of this child so far, this one included
    delay_s: float  # the restart comes this long after the exit
    crash_loop: bool  # `loop_exits` exits within `loop_window_s`
    ran_s: float  # how long the child ran before it exited


@dataclass(slots=True)
class _Child:
    started_at: float
    backoff_s: float
    restarts: int = 0
    exits: deque[float] = field(default_factory=deque)
    restart_at: float | None = None  # set while dead: when to start it again
    crash_loop: bool = False


@dataclass
class Supervisor:
    base_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    stable_after_s: float = 30.0
    loop_window_s: float = 60.0
    loop_exits: int = 5
    children: dict[str, _Child] = field(default_factory=dict)

    def started(self, key: str, now: float) -> None:
        child = self.children.get(key)
        if child is None:
            self.children[key] = _Child(started_at=now, backoff_s=self.base_backoff_s)
            return
        child.started_at = now
        child.restart_at = None

    def exited(self, key: str, returncode: int, now: float) -> Exit:
        """Record an exit; the child becomes due for a restart after the returned delay."""
        child = self.children[key]
        ran_s = now - child.started_at
        if ran_s >= self.stable_after_s:
            child.backoff_s = self.base_backoff_s
            child.crash_loop = False
        child.exits.append(now)
        while child.exits and child.exits[0] < now - self.loop_window_s:
            child.exits.popleft()
        if len(child.exits) >= self.loop_exits:
            child.crash_loop = True
        delay = self.max_backoff_s if child.crash_loop else child.backoff_s
        child.backoff_s = min(self.max_backoff_s, child.backoff_s * 2)
        child.restart_at = now + delay
        child.restarts += 1
        return Exit(key, returncode, child.restarts, delay, child.crash_loop, ran_s)

    def due(self, now: float) -> list[str]:
        """Dead children whose restart time has come, in key order."""
        return sorted(k for k, c in self.children.items() if c.restart_at is not None and c.restart_at <= now)

    def crash_looping(self, now: float) -> list[str]:
        """Children in a crash loop: dead, or not yet running for `stable_after_s` since their last restart."""
        return sorted(
            k
            for k, c in self.children.items()
            if c.crash_loop and (c.restart_at is not None or now - c.started_at < self.stable_after_s)
        )

    def restarts(self) -> dict[str, int]:
        return {k: c.restarts for k, c in sorted(self.children.items()) if c.restarts}

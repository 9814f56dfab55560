"""Turns a target allocation into safe role-switch commands (pure; `now` is a parameter).

Rules, in the order they are applied:
1. Never act on stale stats: an engine whose last `EngineStats` is older than `stale_after_s` is left alone (it may
   be dead or partitioned; its work is redelivered by JetStream anyway).
2. One command in flight per engine: an engine with an unacknowledged command is not commanded again until its ack
   arrives or `ack_timeout_s` passes. A missing ack is never blindly retried: after the timeout the engine's next
   stats say whether it applied the epoch, and the next plan starts from that. An acknowledged switch counts as
   applied (`applied`) until the engine's stats show its epoch, so the next decision neither undoes nor repeats it.
3. Epochs only increase: every command gets the next epoch, above any epoch seen in stats or acks (so an allocator
   that restarts resumes above what engines have applied, and an engine can fence stale commands).
4. Never leave a role empty while it has demand: commands that would leave no prefill-capable (prefill or mixed)
   engine, or no decode-capable (decode or mixed) engine, while that role has demand are dropped.
5. At most `max_concurrent` switches at once among engines that hold work, least in-flight work first, so the
   capacity serving that work never falls off a cliff. An engine that holds nothing (no request running, waiting
   or in flight) drains nothing and serves nobody while it reconfigures, so it switches outside that budget — the
   rule the allocator's start-up already applied to idle engines, now at any time (between RL steps, say).

A move that rule 5 stages goes on as its switches land, not a decision later: the caller hands every applied switch
(an ack live, the end of the switch in the simulator) to `follow_up`, which sends what the budget then allows of the
last target. The engine acknowledges a command once the switch is done (services/engine_agent/role_state.py), so
the budget still bounds how many engines switch at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto import EngineStats, RoleSwitchAck, RoleSwitchCommand

# The drain bound every switch command carries (RoleSwitchCommand.drain_timeout_s, scaled seconds): an engine that
# restarts into another layout keeps decodes expected to end within it and migrates the rest (an in-place switch
# drains nothing: services/engine_agent/switch_rule.py). One value
# for the live allocator, the simulator (SimConfig.drain_bound_s) and the prorsa policy, which prices a move's drain
# with it: a live allocator sending another bound than the one modelled runs a different switch than it planned (it
# sent 30 s while the model and every simulated figure assumed 5: a mover then sat up to 30 s without new work).
DRAIN_TIMEOUT_S = 5.0

PREFILL_CAPABLE = frozenset({"prefill", "mixed"})
DECODE_CAPABLE = frozenset({"decode", "mixed"})


@dataclass
class _Outstanding:
    epoch: int
    role: str
    issued_s: float
    busy: bool = True  # the engine held work when commanded (counts against the concurrency budget)


def _idle(s: EngineStats) -> bool:
    """Holds no work: nothing running, waiting or in flight."""
    return s.running == 0 and s.waiting == 0 and s.in_flight_tokens == 0


@dataclass
class SwitchCoordinator:
    stale_after_s: float = 5.0
    ack_timeout_s: float = 60.0
    max_concurrent_fraction: float = 0.25
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    epoch: int = 0
    stats: dict[str, EngineStats] = field(default_factory=dict)
    seen_at_s: dict[str, float] = field(default_factory=dict)
    outstanding: dict[str, _Outstanding] = field(default_factory=dict)
    # engine → (epoch, role): a switch acknowledged that the engine's stats do not show yet (rule 2)
    applied: dict[str, tuple[int, str]] = field(default_factory=dict)
    timeouts: int = 0
    refused: int = 0
    # The last target and its demand flags, so that a move staged by rule 5 goes on as its switches land
    # (`follow_up`), not a decision interval later.
    goal: dict[str, str] = field(default_factory=dict)
    goal_demand: tuple[bool, bool] = (True, True)
    goal_reason: str = ""

    # --- inputs ---------------------------------------------------------------------------------------------
    def observe_stats(self, s: EngineStats, now: float) -> None:
        prev = self.stats.get(s.engine_id)
        if prev is not None and s.ts_s < prev.ts_s:
            return
        self.stats[s.engine_id] = s
        self.seen_at_s[s.engine_id] = now
        self.epoch = max(self.epoch, s.epoch)
        out = self.outstanding.get(s.engine_id)
        if out is not None and s.epoch >= out.epoch and not s.switching:
            del self.outstanding[s.engine_id]  # applied; the ack may have been lost
        acked = self.applied.get(s.engine_id)
        if acked is not None and s.epoch >= acked[0] and not s.switching:
            del self.applied[s.engine_id]  # the stats have caught up with the acknowledged switch

    def observe_ack(self, ack: RoleSwitchAck, now: float) -> bool:
        """Fold an ack in. True when it lands an outstanding command's switch (then `follow_up` may go on)."""
        self.epoch = max(self.epoch, ack.epoch)
        out = self.outstanding.get(ack.engine_id)
        if out is None or ack.epoch < out.epoch:
            return False  # a repeat (the reply and the ack subject both carry it) or an older command's
        del self.outstanding[ack.engine_id]
        if not ack.ok:
            # The next decision asks again, if it still wants this; a follow-up would hammer a refusal.
            self.refused += 1
            self.goal.pop(ack.engine_id, None)
            return False
        self.applied[ack.engine_id] = (ack.epoch, ack.role)
        return True

    def expire(self, now: float) -> list[str]:
        """Forget commands whose ack is overdue; returns the engines concerned (for logs and metrics)."""
        late = [e for e, o in self.outstanding.items() if now - o.issued_s > self.ack_timeout_s]
        for e in late:
            del self.outstanding[e]
        self.timeouts += len(late)
        return late

    # --- decisions ------------------------------------------------------------------------------------------
    def fresh_engines(self, now: float) -> dict[str, EngineStats]:
        return {e: s for e, s in self.stats.items() if now - self.seen_at_s[e] <= self.stale_after_s}

    def current_roles(self, now: float) -> dict[str, str]:
        """Role of every fresh engine, counting an acknowledged or unacknowledged command as already applied."""
        roles = {e: s.role for e, s in self.fresh_engines(now).items()}
        for e, (_, role) in self.applied.items():
            if e in roles:
                roles[e] = role
        for e, o in self.outstanding.items():
            if e in roles:
                roles[e] = o.role
        return roles

    def commands_for(
        self,
        target: dict[str, str],
        now: float,
        prefill_demand: bool = True,
        decode_demand: bool = True,
        reason: str = "",
    ) -> list[RoleSwitchCommand]:
        """The commands that move the fleet toward `target` now, within the rules above."""
        self.goal, self.goal_demand, self.goal_reason = dict(target), (prefill_demand, decode_demand), reason
        self.expire(now)
        fresh = self.fresh_engines(now)
        roles = self.current_roles(now)
        wanted = [
            e
            for e, r in target.items()
            if e in fresh and e not in self.outstanding and roles.get(e) != r and not fresh[e].switching
        ]
        wanted.sort(key=lambda e: (fresh[e].in_flight_tokens, fresh[e].running, e))  # least work first
        busy_outstanding = sum(o.busy for o in self.outstanding.values())
        budget = max(1, int(len(fresh) * self.max_concurrent_fraction)) - busy_outstanding
        commands: list[RoleSwitchCommand] = []
        for e in wanted:
            busy = not _idle(fresh[e])
            if busy and budget <= 0:
                continue  # rule 5 (an idle engine later in the list may still go)
            trial = dict(roles, **{e: target[e]})
            if _uncovers(roles, trial, prefill_demand, decode_demand):
                continue  # rule 4: this switch would empty a role that has demand
            self.epoch += 1
            commands.append(
                RoleSwitchCommand(
                    engine_id=e,
                    role=target[e],
                    epoch=self.epoch,  # type: ignore[arg-type]
                    issued_s=now,
                    reason=reason,
                    drain_timeout_s=self.drain_timeout_s,
                )
            )
            self.outstanding[e] = _Outstanding(self.epoch, target[e], now, busy)
            roles = trial
            budget -= busy
        return commands

    def follow_up(self, now: float) -> list[RoleSwitchCommand]:
        """What the budget allows now of the last target (module doc): called when a switch has landed, so a move
        staged by rule 5 takes as many switch times as it has stages, not as many decision intervals (8 colocated
        engines to 5:3 took 17 s at a quarter per 5 s plan on deepseek-v3.2 at 512 trajectories, 8 s this way:
        an in-place switch takes the profile's `role_switch_s`, 2 s)."""
        roles = self.current_roles(now)
        rest = {e: r for e, r in self.goal.items() if roles.get(e) != r}
        if not rest:
            return []
        return self.commands_for(rest, now, *self.goal_demand, self.goal_reason)


def _uncovers(
    before: dict[str, str], after: dict[str, str], prefill_demand: bool, decode_demand: bool
) -> bool:
    """True if `after` leaves a role with demand without any capable engine that `before` had."""
    b, a = set(before.values()), set(after.values())
    for demand, capable in ((prefill_demand, PREFILL_CAPABLE), (decode_demand, DECODE_CAPABLE)):
        if demand and b & capable and not a & capable:
            return True
    return False

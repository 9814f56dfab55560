"""What the allocator service observes, turned into a policy's `ClusterView` (pure; `now` is a parameter).

* `RecentLoad` sums request-level load between two decisions, from the bus's lifecycle and engine events:
  `TurnSubmitted` (a request arrives; its new tokens), `PrefillDone` (new vs cached tokens actually computed, and
  apart what the turns sent away from their engine's cache computed), `RequestFinished` (output length).
  `take(now)` returns the window's figures and starts the next window.
* `QueueDepth` is what the WORK stream holds: prefill requests and decode handoffs not yet acknowledged. Messages an
  engine has pulled stay in a work-queue stream until acked, so the engines' own running + waiting are subtracted.
* `build_view` makes the ClusterView from fresh engine stats only (the caller filters them by age), the roles the
  allocator has asked for and had acknowledged, the queues, the recent load and the latest forecast.

EngineStats does not carry everything an EngineView has; the mapping below says what stands in:
  queued_prefill_tokens ← in_flight_tokens of a prefill-role engine (its in-flight work is prompt tokens) times the
                          share of prompt tokens recent prefills computed, else 0;
  decode_batch          ← running of a decode or mixed engine (its running batch), else 0.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from proto import EngineStats
from services.allocator.capacity import DEFAULT_ISL_TOKENS
from services.allocator.policy import ClusterView, EngineView


@dataclass
class RecentWindow:
    window_s: float
    requests: int
    mean_isl_tokens: float
    mean_cached_tokens: float
    mean_osl_tokens: float
    mean_new_tokens: float = 0.0  # new prompt tokens per submitted turn (what the client appended)
    # Prefills of turns sent away from the engine holding their prefix (PrefillDone.away), and the prompt tokens
    # each of them computed.
    away_prefills: int = 0
    mean_away_new_tokens: float = 0.0
    finished: int = 0  # answers that ended in the window (the count `mean_osl_tokens` is the mean of)


@dataclass
class RecentLoad:
    """Request-level load since the last `take`."""

    started_s: float | None = None
    requests: int = 0
    submitted_new_tokens: int = 0
    submitted_prompt_tokens: int = 0
    prefills: int = 0
    prefill_new_tokens: int = 0
    prefill_cached_tokens: int = 0
    away_prefills: int = 0
    away_new_tokens: int = 0
    finished: int = 0
    output_tokens: int = 0

    def observe_turn(self, new_tokens: int, prompt_tokens: int) -> None:
        self.requests += 1
        self.submitted_new_tokens += new_tokens
        self.submitted_prompt_tokens += prompt_tokens

    def observe_prefill(self, new_tokens: int, cached_tokens: int, away: bool = False) -> None:
        self.prefills += 1
        self.prefill_new_tokens += new_tokens
        self.prefill_cached_tokens += cached_tokens
        if away:
            self.away_prefills += 1
            self.away_new_tokens += new_tokens

    def observe_finished(self, output_tokens: int) -> None:
        self.finished += 1
        self.output_tokens += output_tokens

    def take(self, now: float) -> RecentWindow:
        """The window since the last take (0 s and no figures the first time), then start a new one."""
        window_s = max(0.0, now - self.started_s) if self.started_s is not None else 0.0
        out = self.window(window_s)
        for f in fields(self):
            setattr(self, f.name, f.default)
        self.started_s = now
        return out

    def window(self, window_s: float) -> RecentWindow:
        """The means over what was observed (the simulator fills the counts from its totals and asks this)."""
        if self.prefills:  # what engines computed is the truth about cache hits
            isl = self.prefill_new_tokens / self.prefills
            cached = self.prefill_cached_tokens / self.prefills
        elif self.requests:  # else what clients sent: new tokens appended, the rest cacheable at best
            isl = self.submitted_new_tokens / self.requests or self.submitted_prompt_tokens / self.requests
            cached = max(0.0, self.submitted_prompt_tokens / self.requests - isl)
        else:
            isl = cached = 0.0
        osl = self.output_tokens / self.finished if self.finished else 0.0
        new = self.submitted_new_tokens / self.requests if self.requests else 0.0
        away = self.away_new_tokens / self.away_prefills if self.away_prefills else 0.0
        return RecentWindow(
            window_s, self.requests, isl, cached, osl, new, self.away_prefills, away, self.finished
        )


@dataclass(frozen=True, slots=True)
class QueueDepth:
    prefill_messages: int = 0  # prefill requests in the WORK stream (pulled ones included)
    decode_messages: int = 0  # decode handoffs in the WORK stream (pulled ones included)


def engine_view(
    s: EngineStats, target_role: str = "", role: str = "", computed_fraction: float = 1.0
) -> EngineView:
    """An EngineView from stats; `role` overrides the reported role (a switch acked before stats caught up) and
    `target_role` marks an unacknowledged command. `computed_fraction`: the share of a prompt's tokens that
    prefills recently computed (the rest were prefix-cache hits) — a prefill engine reports whole contexts in
    flight, not knowing their hits before it computes them."""
    current = role or s.role
    return EngineView(
        engine_id=s.engine_id,
        role=current,
        running=s.running,
        waiting=s.waiting,
        queued_prefill_tokens=round(s.in_flight_tokens * computed_fraction) if current == "prefill" else 0,
        decode_batch=s.running if current in ("decode", "mixed") else 0,
        kv_used_tokens=s.kv_used_tokens,
        kv_capacity_tokens=s.kv_capacity_tokens,
        in_flight_tokens=s.in_flight_tokens,
        switching=s.switching or bool(target_role and target_role != current),
        target_role=target_role if target_role and target_role != current else "",
        prefill_tokens_per_s=s.prefill_tokens_per_s,
        decode_tokens_per_s=s.decode_tokens_per_s,
        prefix_cache_tokens=s.prefix_cache_tokens,
        restart_roles=tuple(s.restart_roles),
    )


def build_view(
    now: float,
    stats: dict[str, EngineStats],
    targets: dict[str, str],
    applied: dict[str, str],
    queue: QueueDepth,
    recent: RecentWindow,
    forecast: object | None = None,
) -> ClusterView:
    """The ClusterView of the engines in `stats` (already filtered to fresh ones); `targets` are unacknowledged
    commands (engine → role) and `applied` acknowledged roles the stats do not show yet."""
    # Prompt tokens held by prefill engines count at the share recent prefills computed: with prefix caching most of
    # a multi-turn context is a hit, and whole contexts overstated the backlog by the hit rate (a reactive policy
    # switched 65 times on general · qwen3-235b once the simulator built its views here, against 10 before and 1
    # with this share).
    seen = recent.mean_isl_tokens + recent.mean_cached_tokens
    fraction = recent.mean_isl_tokens / seen if seen > 0 else 1.0
    engines = tuple(
        engine_view(s, targets.get(e, ""), applied.get(e, ""), fraction) for e, s in sorted(stats.items())
    )
    # Pulled messages stay in the stream until acked: a prefill engine's prompts until handed off, a mixed engine's
    # turns until they finish (so its whole batch), a decode engine's handoffs until they finish.
    pulled_prefill = sum(v.running + v.waiting for v in engines if v.role in ("prefill", "mixed"))
    pulled_decode = sum(v.running + v.waiting for v in engines if v.role == "decode")
    waiting_prefill = max(0, queue.prefill_messages - pulled_prefill)
    isl = recent.mean_isl_tokens if recent.mean_isl_tokens > 0 else DEFAULT_ISL_TOKENS
    return ClusterView(
        now=now,
        engines=engines,
        prefill_queue_tokens=sum(v.queued_prefill_tokens for v in engines) + round(waiting_prefill * isl),
        decode_queue_len=max(0, queue.decode_messages - pulled_decode),
        prefill_tokens_per_s=sum(v.prefill_tokens_per_s for v in engines),
        decode_tokens_per_s=sum(v.decode_tokens_per_s for v in engines),
        forecast=forecast,
        recent_window_s=recent.window_s,
        recent_requests=recent.requests,
        recent_mean_isl_tokens=recent.mean_isl_tokens,
        recent_mean_cached_tokens=recent.mean_cached_tokens,
        recent_mean_osl_tokens=recent.mean_osl_tokens,
        recent_mean_new_tokens=recent.mean_new_tokens,
        recent_away_prefills=recent.away_prefills,
        recent_mean_away_new_tokens=recent.mean_away_new_tokens,
        recent_finished=recent.finished,
        prefill_queue_len=sum(v.waiting for v in engines if v.role in ("prefill", "mixed")) + waiting_prefill,
    )

"""Prorsa's objective: how long a prefill/decode split takes to finish the work in flight plus the work forecast.

Pure arithmetic over `HorizonDemand`s and the capacity model. For one horizon h:
  Wp  prompt tokens to prefill: queued now + forecast to arrive within h;
  Wd  output tokens to generate within h (at least what running decodes still owe, plus queued handoffs);
  C   mean decoding sequences over h, ctx their mean context.
A split of P prefill and D decode engines finishes that work in
  T = max(Wp / (P · rp), Wd / Rd(D, C, ctx)),
rp being one prefill engine's rate and Rd the decode rate of D engines sharing C sequences (capacity module; more
decode engines than sequences add nothing). A role with work and no engine takes forever.

Moving engines costs (`MoveCosts`, from the engines that would move — the cheapest of their role first, exactly the
ones `moves_for_split` picks):
* delay: a mover serves its new role only after role_switch seconds, plus min(drain, drain_timeout) when the new
  role does not serve the work it holds (decode → prefill, mixed → prefill, prefill → decode; moves to and from
  mixed keep serving, as the engine agent keeps running decodes its new role serves); the role that gains engines
  loses that many engine-seconds, so its time grows by lost / (its engines) (spread over the whole fleet when the
  target has a mixed engine);
* recompute: an engine that becomes decode-only drops the prefix cache it holds (as its stats report it, else its
  KV in use; one that moves between prefill and mixed keeps it), and decodes that outlast the drain timeout are
  migrated by re-prefill (their KV): both add to Wp.
With M mixed engines (chunked prefill + decode in one step), T is the least time at which the mixed engines' chunked
prefill covers what the P prefill engines leave of Wp, and their remaining steps decode what the D decode engines
leave of Wd (found by bisection; the time is monotone in the work).

Score of a split = mean over horizons of T_h / h: a fraction of the horizon (≤ 1 keeps up with the forecast);
recompute is amortised over `amortize_s` (see `score`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.allocator.capacity import CapacityModel
from services.allocator.policies.common import Split, engines_by_role
from services.allocator.policy import ClusterView

ROLE_ORDER = ("prefill", "decode", "mixed")


@dataclass(frozen=True, slots=True)
class HorizonDemand:
    horizon_s: float  # > 0
    prefill_tokens: float  # Wp
    decode_tokens: float  # Wd
    sequences: float  # C, ≥ 1 whenever Wd > 0
    context_per_seq_tokens: float  # ctx


@dataclass(frozen=True, slots=True)
class MoveCosts:
    """Cumulative costs of moving the k cheapest engines out of each role: index k, k = 0 costs nothing."""

    engine_s: dict[str, list[float]]  # seconds the k movers spend draining work their new role does not serve
    prefill_tokens: dict[str, list[float]]  # tokens the k movers leave to be recomputed (migrated decodes)
    # prefix cache the k movers hold: lost only if they become decode-only
    cache_tokens: dict[str, list[float]]
    switch_s: float = 0.0  # reconfiguration per mover


@dataclass(frozen=True, slots=True)
class Rates:
    prefill_per_engine: float  # rp, tokens/s
    cached_tokens: float  # mean prefix before a prompt chunk (mixed-step attention cost)
    prompt_tokens: float | None = None  # mean uncached tokens per prompt (a mixed step's chunk, DP attention)


def move_costs(view: ClusterView, cap: CapacityModel, drain_timeout_s: float, rates: Rates) -> MoveCosts:
    """Prefix sums of the cost of moving engines out of each role, cheapest first (see module doc)."""
    engine_s: dict[str, list[float]] = {}
    tokens: dict[str, list[float]] = {}
    cache: dict[str, list[float]] = {}
    for role, members in engines_by_role(view).items():
        acc_s, acc_t, acc_c = [0.0], [0.0], [0.0]
        for e in members:
            drain = cap.drain_s(
                role, e.in_flight_tokens, e.decode_batch, e.kv_used_tokens, rates.prefill_per_engine
            )
            migrated = e.kv_used_tokens if role in ("decode", "mixed") and drain > drain_timeout_s else 0
            # Its prefix cache, recomputed by the next turns elsewhere (KV in use when the cache is not reported).
            held = max(e.kv_used_tokens, e.prefix_cache_tokens) if role in ("prefill", "mixed") else 0
            acc_s.append(acc_s[-1] + min(drain, drain_timeout_s))
            acc_t.append(acc_t[-1] + migrated)
            acc_c.append(acc_c[-1] + held)
        engine_s[role], tokens[role], cache[role] = acc_s, acc_t, acc_c
    return MoveCosts(engine_s, tokens, cache, cap.profile.role_switch_s)


def transition(current: Split, target: Split, costs: MoveCosts) -> tuple[float, float, set[str]]:
    """(engine-seconds lost, tokens to recompute, roles that gain engines) of moving from `current` to `target`."""
    lost_s = lost_tokens = 0.0
    gaining: set[str] = set()
    gained = {role: max(0, target.of(role) - current.of(role)) for role in ROLE_ORDER}
    total = max(1, sum(gained.values()))
    # Where the movers go, as shares: one that becomes decode-only drops its prefix cache and finishes its
    # prefills; one that becomes prefill-only drains its decodes (or migrates them); a move between a role and
    # `mixed` keeps serving what both roles serve (as the engine agent does), so it drains nothing.
    to_decode, to_prefill = gained["decode"] / total, gained["prefill"] / total
    for role in ROLE_ORDER:
        out = current.of(role) - target.of(role)
        if out > 0:
            k = min(out, len(costs.engine_s[role]) - 1)
            drains = to_decode if role == "prefill" else to_prefill
            lost_s += k * costs.switch_s + drains * costs.engine_s[role][k]
            lost_tokens += drains * costs.prefill_tokens[role][k] + to_decode * costs.cache_tokens[role][k]
        elif out < 0:
            gaining.add(role)
    return lost_s, lost_tokens, gaining


def _ratio_s(work: float, rate: float) -> float:
    if work <= 0:
        return 0.0
    return work / rate if rate > 0 else math.inf


def horizon_time_s(
    split: Split,
    d: HorizonDemand,
    cap: CapacityModel,
    rates: Rates,
    extra_prefill: float,
    lost_s: float,
    gaining: set[str],
) -> float:
    """T for one horizon (module doc), the switch delay charged to the roles that gain engines."""
    # Lost cache only costs while prompts keep coming: with no prefill work there is nothing to recompute it for.
    wp = d.prefill_tokens + extra_prefill if d.prefill_tokens > 0 else 0.0
    if split.mixed:
        delay = lost_s / split.total if gaining else 0.0
        return _mixed_time_s(split, d, cap, rates, wp) + delay
    t_prefill = _ratio_s(wp, split.prefill * rates.prefill_per_engine)
    rd = cap.decode_cluster_tokens_per_s(split.decode, d.sequences, d.context_per_seq_tokens)
    t_decode = _ratio_s(d.decode_tokens, rd)
    if "prefill" in gaining and t_prefill > 0:
        t_prefill += lost_s / split.prefill
    if "decode" in gaining and t_decode > 0:
        t_decode += lost_s / split.decode
    return max(t_prefill, t_decode)


def _mixed_time_s(split: Split, d: HorizonDemand, cap: CapacityModel, rates: Rates, wp: float) -> float:
    """Least T at which P prefill + D decode + M mixed engines finish Wp and Wd (bisection)."""
    wd = d.decode_tokens
    if wp <= 0 and wd <= 0:
        return 0.0
    decoders = split.decode + split.mixed
    per_engine = d.sequences / decoders
    rp_mixed, rd_chunking, rd_pure = cap.mixed_tokens_per_s(
        per_engine, d.context_per_seq_tokens, rates.cached_tokens, rates.prompt_tokens
    )
    rd_dedicated = cap.decode_cluster_tokens_per_s(
        split.decode, per_engine * split.decode, d.context_per_seq_tokens
    )
    rp_dedicated = split.prefill * rates.prefill_per_engine

    def feasible(t: float) -> bool:
        need_p = max(0.0, wp - t * rp_dedicated)
        # fraction of the mixed engines' steps that carry prefill chunks
        share = need_p / (t * split.mixed * rp_mixed) if need_p > 0 else 0.0
        if share > 1.0:
            return False
        mixed_decode = t * split.mixed * (share * rd_chunking + (1.0 - share) * rd_pure)
        return t * rd_dedicated + mixed_decode >= wd

    hi = max(d.horizon_s, 1e-3)
    while not feasible(hi):
        hi *= 2.0
        if hi > 1e9:
            return math.inf
    lo = 0.0
    for _ in range(40):
        mid = (lo + hi) / 2.0
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def score(
    split: Split,
    current: Split,
    demands: Sequence[HorizonDemand],
    cap: CapacityModel,
    rates: Rates,
    costs: MoveCosts,
    amortize_s: float = 0.0,
) -> float:
    """Mean over horizons of T_h / h for `split`, reached from `current` (inf if a role with work has no engine).

    `amortize_s` = 0: the move's costs are charged inside every horizon (delay and recompute, module doc).
    `amortize_s` > 0: the split is scored as it will run once reached (no costs inside the horizons), plus the
    time the move costs as a fraction of `amortize_s` — the time the split is expected to serve. A switch's cost
    is paid once (a drain, a reconfiguration, a prefix cache recomputed as its trajectories return from their
    tools) while its gain lasts as long as the demand keeps its shape; charged whole to a 5 s horizon it would
    forbid every move whose gain takes longer than that to pay back."""
    lost_s, extra, gaining = transition(current, split, costs)
    if amortize_s <= 0:
        total = sum(
            horizon_time_s(split, d, cap, rates, extra, lost_s, gaining) / d.horizon_s for d in demands
        )
        return total / len(demands)
    steady = sum(horizon_time_s(split, d, cap, rates, 0.0, 0.0, set()) / d.horizon_s for d in demands)
    gainers = sum(split.of(r) for r in gaining) or split.total
    prefillers = split.prefill + split.mixed
    cost_s = lost_s / gainers + (
        extra / (prefillers * rates.prefill_per_engine) if extra > 0 and prefillers else 0.0
    )
    return steady / len(demands) + cost_s / amortize_s

"""How long a turn takes under a prefill/decode split: a closed queueing model of the agentic loop.

Pure arithmetic on the capacity model (`capacity.py`, which wraps the performance model the simulator and the
simulated engines use). Prorsa is judged on trajectory completion time, and a trajectory's time is the sum of its
turns' times: tool call, wait for a prefill slot, prefill, KV handoff, then output tokens × TPOT. So the allocator
projects the time of one turn, R(split), and picks the split with the least.

Why a *closed* model: an agent only sends its next prompt after its last answer and tool call, so the number of
live trajectories N, not an arrival rate, is what the cluster faces; a slower split does not face more arrivals, it
serves the same N more slowly (Little: turn throughput X = N / R). Every split "keeps up" with an open arrival
rate in such a loop, which is why the throughput objective this replaces could not tell splits apart.

Stations a turn visits (Schweitzer's approximate mean value analysis, solved as a damped fixed point):
* tool: a delay of `tool_s` (no queueing: tools run in parallel);
* prefill: P single-server queues, each visited by 1/P of the turns; service = the prompt's uncached tokens at the
  engine's prefill rate. A split's prefill engine holds the prompt it computed but not the decode engine's answer,
  so it recomputes the last output (`prorsa.sim.engine` header; vLLM's KV connectors do not send KV back):
  uncached = new + output tokens; a mixed engine caches prompt + answer, so uncached = new tokens;
  on a prefill engine a prefix is evicted (LRU) from the trajectories that wait longest — the turns the affinity
  rule sends away already (below): at 512 trajectories on qwen3-235b at 4:4, 1,640 whole-context recomputes
  against 1,706 turns sent away — so the affinity term prices it, and no capacity term is added here.
  Placement sends a turn away when more prompts wait at its engine than its recompute is worth
  (`services.runtime.affinity`: context / new tokens, at least 8), so each engine's queue of its own trajectories is
  an M/M/1/C queue that refuses an arrival finding C = patience + 1 prompts: the share sent away is its blocking
  probability, (1 − ρ) ρ^C / (1 − ρ^(C+1)), and one of them recomputes what the engines measure such a turn
  computing where another engine takes it (`_elsewhere`, `_miss_tokens`);
* handoff: a delay of the KV transfer of the context (split only);
* decode: D engines, continuous batching. A sequence arriving on an engine with q others decodes at the step
  time of a batch of q + 1 (arrival theorem), capped by the batch limit (max_batch and KV room), beyond which it
  waits for a slot; its time is output tokens × step time;
* mixed engines (colocation): prefill and decode share every step. Prompts are chunked at `mixed_chunk_tokens`
  per rank and step; with DP attention a prompt lives on one of `dp_ranks` ranks (a dp-server station, Seidmann's
  approximation: a server dp times faster plus a fixed delay), and any rank's chunk makes the whole step as long as
  that chunk costs at 1/dp of the engine's rate (perf_model.mixed_step_time_s: one rank's prefill stalls every
  rank's decode). A decoding sequence's step is a mixed step with the probability that some rank is chunking:
  1 − exp(−busy ranks) with DP ranks (independent ranks), the busy fraction with one rank.

Outputs are means: `TurnTime.turn_s` (R), `turns_per_s` (X), and the parts. `projected_turns` turns R into the
number of turns the cluster completes over a horizon when it first spends `switch_s` in a transitional split —
the currency the prorsa policy trades switch costs in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.allocator.capacity import CapacityModel
from services.allocator.policies.common import Split
from services.runtime import perf_model as pm
from services.runtime.affinity import MAX_WAITING, patience, worth_prompts

_ITERATIONS = 60  # fixed-point iterations; the damped update converges to < 0.1 % in ~30 on every profile
_DAMPING = 0.5
_TOLERANCE = 1e-4  # stop once R moves by less than this fraction between iterations


@dataclass(frozen=True, slots=True)
class TurnShape:
    """The mean turn of the work at hand (tokens per turn, seconds per tool call)."""

    new_tokens: float  # new prompt tokens per turn (the tool's observation, or a first prompt)
    output_tokens: float  # generated tokens per turn
    context_tokens: float  # context at prefill (prefix + new tokens)
    tool_s: float  # tool call after a turn (0 for the last turn)

    def __post_init__(self) -> None:
        for name in ("new_tokens", "output_tokens", "context_tokens", "tool_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"TurnShape.{name} must be finite and >= 0, got {v}")


@dataclass(frozen=True, slots=True)
class TurnTime:
    """Mean time of one turn under a split, and its parts (seconds)."""

    turn_s: float  # R: tool + prefill wait and compute + handoff + decode
    turns_per_s: float  # X = N / R
    prefill_s: float  # wait + compute
    decode_s: float  # output tokens × step time (including the wait for a batch slot)
    handoff_s: float
    tool_s: float
    # A split's congested branch (`_disaggregated`): its queue does not drain, so it is its state, not a stock.
    congested: bool = False


def turn_time(
    split: Split,
    shape: TurnShape,
    trajectories: float,
    cap: CapacityModel,
    max_waiting: float = MAX_WAITING,
    queued_prefills: float = 0.0,
    queued_tokens: float = 0.0,
    queue_patience: float = 0.0,
) -> TurnTime:
    """R and X for `trajectories` live trajectories on `split` (a plain P:D split or full colocation 0:0:M).

    A split with a role that has work and no engine gets R = inf. Hybrids (mixed beside dedicated engines) are
    modelled as colocation over the mixed engines with the dedicated ones idle — the prorsa policy does not offer
    them (affinity keeps a trajectory's turns on the mixed engine holding its cache). `max_waiting`: the least
    patience of placement's affinity rule, in prompts (`services.runtime.affinity`).
    `queued_prefills`, `queued_tokens`: prompts and their tokens waiting for prefill in the cluster now. Colocation
    takes their share of misses as its state when they alone are past the rule's patience
    (`_congested_miss_share`); a split takes its congested branch when they are past its prefill engines' patience
    and its misses keep them there (`_disaggregated`, `TurnTime.congested`), else its loop settles where it would
    from no misses — and a caller prices the queue as a stock to work off. `queue_patience`: the patience of the
    turns queued now, which the queue is past or not (0: this shape's) — a caller pricing a later turn (longer
    contexts, more patience) asks whether today's queue is congested, and whether that congestion lasts there."""
    n = max(float(trajectories), 0.0)
    if n <= 0:
        return TurnTime(0.0, 0.0, 0.0, 0.0, 0.0, shape.tool_s)
    if split.mixed:
        return _colocated(split.mixed, shape, n, cap, max_waiting, queued_prefills, queued_tokens)
    if split.prefill <= 0 or split.decode <= 0:
        return TurnTime(math.inf, 0.0, math.inf, math.inf, 0.0, shape.tool_s)
    return _disaggregated(
        split.prefill,
        split.decode,
        shape,
        n,
        cap,
        max_waiting,
        queued_prefills,
        queued_tokens,
        queue_patience,
    )


def turn_patience(shape: TurnShape, max_waiting: float = MAX_WAITING) -> float:
    """Placement's patience for the mean turn of `shape`, in prompts queued at its engine
    (`services.runtime.affinity`)."""
    return patience(worth_prompts(shape.context_tokens, shape.new_tokens), max_waiting)


def _decode_context(shape: TurnShape) -> float:
    # KV of a decoding sequence, averaged over its decode: the prompt plus half the answer.
    return max(1.0, shape.context_tokens + shape.output_tokens / 2.0)


class _DecodeStep:
    """Step time of one engine decoding `batch` (≥ 1, fractional: interpolated between whole batches) sequences of
    `ctx` context, from the performance model; the fixed-point iterations ask for the same batches again and again,
    so whole-batch times are kept."""

    __slots__ = ("cap", "ctx", "_t")

    def __init__(self, cap: CapacityModel, ctx: float) -> None:
        self.cap, self.ctx = cap, ctx
        self._t: dict[int, float] = {}

    def _whole(self, b: int) -> float:
        t = self._t.get(b)
        if t is None:
            t = self._t[b] = pm.decode_step_time_s(self.cap.profile, b, round(b * self.ctx))
        return t

    def __call__(self, batch: float) -> float:
        lo = max(1, math.floor(batch))
        t_lo, t_hi = self._whole(lo), self._whole(lo + 1)
        return (t_lo + (batch - lo) * (t_hi - t_lo)) / self.cap.decode_correction


def _congested_miss_share(
    queued_prefills: float,
    queued_tokens: float,
    engines: int,
    hit_tokens: float,
    whole_tokens: float,
    patience_prompts: float,
) -> float | None:
    """The congested branch's start: when the prefill queue the cluster holds now is, on its own, past placement's
    patience on each of `engines` (more prompts each than a turn waits behind), the share of misses in it — its
    mean job placed between a hit's `hit_tokens` and a miss's `whole_tokens` (`_miss_tokens`) — for
    the engines there are to miss on (`_elsewhere`). None while the queue is shorter or there is no other engine."""
    if queued_prefills <= 0 or queued_prefills / engines <= patience_prompts or engines < 2:
        return None
    mean_job = queued_tokens / queued_prefills
    return _elsewhere(engines) * min(
        1.0, max(0.0, (mean_job - hit_tokens) / max(whole_tokens - hit_tokens, 1.0))
    )


def cache_hit_share(capacity_tokens: float, working_set_tokens: float) -> float:
    """The share of turns whose prefix an engine's LRU prefix cache still holds when the trajectory comes back:
    min(1, capacity / working set). Che's approximation of LRU (Che, Tung and Wang, IEEE JSAC 2002) under
    independent references — each trajectory's prefix is reused about once per turn cycle, in an order the
    tool calls shuffle — gives a hit probability 1 − exp(−T/R) for every item, with T the cache's characteristic
    time; filling the capacity (Σ size × (1 − exp(−T/R)) = capacity) makes it capacity / working set. The
    engines' caches are LRU by last insertion (`services.engine_agent.prefix_cache`, vLLM's and SGLang's evictors)
    bounded by the KV capacity left after running work; the working set is the cached prefixes of the live
    trajectories homed on the engine (CALIBRATION.md: hit rates of 0.61 under LRU on Mooncake's tool-agent trace and
    below 20 % on a decode rank holding ~162k tokens for 50 prefix groups — the pressure this term prices)."""
    if working_set_tokens <= capacity_tokens:
        return 1.0
    return max(0.0, capacity_tokens) / working_set_tokens


def host_tier_share(p: pm.ModelProfile, working_set_tokens: float, device_kept: float) -> float:
    """The share of turns whose prefix the engine's device cache lost but its host KV tier still holds (0 without
    one): they reload the prefix over PCIe instead of recomputing it. The tier is written through, so it holds
    what the GPUs hold and more (`services.engine_agent.prefix_cache`), an LRU of its own capacity: by
    `cache_hit_share`'s approximation it holds min(1, host / working set) of the prefixes, `device_kept` of them on
    the GPUs too. A turn sent to another engine finds nothing there either (HiCache's host tier is private to its
    instance), so only capacity misses move — which is why a split's pricing (`_disaggregated`) has no term."""
    if p.host_kv_tokens <= 0:
        return 0.0
    return max(0.0, cache_hit_share(p.host_kv_tokens, working_set_tokens) - device_kept)


def host_reload_stall_s(p: pm.ModelProfile, context_tokens: float, step_s: float) -> float:
    """Seconds a host-tier hit adds to the step that starts its prompt (0 without a tier): the reload of its context
    (`perf_model.host_reload_time_s`) overlaps the step layer by layer (HiCache), so only what outlasts a step of
    `step_s` stalls it, as the engines price it (`perf_model.host_reload_step_s`)."""
    if p.host_kv_tokens <= 0:
        return 0.0
    return max(0.0, pm.host_reload_time_s(p, round(context_tokens)) - step_s)


def sent_away(rho: float, patience_prompts: float) -> float:
    """The share of turns placement sends away from their engine: the blocking probability of an M/M/1/C queue,
    C = patience + 1 (a turn stays while at most `patience_prompts` wait there), at utilisation `rho`:
    (1 − ρ) ρ^C / (1 − ρ^(C+1)); 1 / (C + 1) at ρ = 1 and 1 − 1/ρ as ρ grows. Bounded where the M/M/1 tail it
    replaces was not: the engine's queue of its own trajectories cannot grow past C — what would is shed to the
    shared queue, which engines with room pull — so near saturation about one turn in C is sent away, not all of
    them. (The unbounded tail let a turn's whole-context recompute feed a queue without end: it priced 5:3 on
    deepseek-v3.2 at 433 live trajectories at 82 s a turn, 77 % of turns recomputed, where the run measured 4 %
    sent away and the best split of the cell.)"""
    if rho <= 0:
        return 0.0
    c = math.floor(patience_prompts) + 1
    if abs(rho - 1.0) < 1e-9:
        return 1.0 / (c + 1)
    if rho < 1.0:
        return (1.0 - rho) * rho**c / (1.0 - rho ** (c + 1))
    r = 1.0 / rho  # the same ratio, divided through by ρ^(C+1): no overflow however large ρ is
    return (1.0 - r) / (1.0 - r ** (c + 1))


def _elsewhere(engines: int) -> float:
    """The share of turns sent away from their engine that land on another one. Placement pulls (prorsa.sim.router,
    the client's directory): a turn its engine cannot take now goes to the shared queue, and whichever of the
    `engines` prefill-capable engines pulls it next takes it — its own engine among them, about 1 in `engines`,
    and then its prefix is still there. With one engine a turn cannot miss at all: it can only wait."""
    return (engines - 1) / engines


def _miss_tokens(cap: CapacityModel, hit_uncached: float, ctx_in: float) -> float:
    """Prompt tokens a turn sent away computes where another engine takes it: `cap.miss_share` of the mean context
    (what the engines report such turns computing, `CapacityModel._fold_misses`; the whole context until they have),
    never less than a hit computes."""
    return max(hit_uncached, cap.miss_share * ctx_in)


def _disaggregated(
    n_prefill: int,
    n_decode: int,
    shape: TurnShape,
    n: float,
    cap: CapacityModel,
    max_waiting: float,
    queued_prefills: float = 0.0,
    queued_tokens: float = 0.0,
    queue_patience: float = 0.0,
) -> TurnTime:
    hit_uncached = max(1.0, shape.new_tokens + shape.output_tokens)
    ctx_in = max(hit_uncached, shape.context_tokens)
    rate_hit = cap.prefill_tokens_per_s(hit_uncached, ctx_in - hit_uncached)
    miss_uncached = _miss_tokens(cap, hit_uncached, ctx_in)
    rate_miss = cap.prefill_tokens_per_s(miss_uncached, max(0.0, ctx_in - miss_uncached))
    handoff = pm.kv_transfer_time_s(cap.profile, round(shape.context_tokens))
    ctx = _decode_context(shape)
    limit = cap.decode_batch_limit(ctx)
    step = _DecodeStep(cap, ctx)
    out = max(1.0, shape.output_tokens)
    shrink = max(0.0, (n - 1.0) / n)  # Schweitzer: the queue an arrival sees, without itself (none below one)
    # Placement's rule (services.runtime.affinity): a turn leaves its engine when more prompts wait there than its
    # recompute is worth (`sent_away`); it then recomputes a miss's tokens if another engine takes it.
    patience_prompts = turn_patience(shape, max_waiting)
    elsewhere = _elsewhere(n_prefill)

    def service(miss: float) -> float:
        """A prefill engine's seconds per turn when a share `miss` of turns are misses."""
        return (1.0 - miss) * hit_uncached / rate_hit + miss * miss_uncached / rate_miss

    def solve(miss: float, q_p: float, q_d: float) -> tuple[float, float, float, float, float, float]:
        """The network's mean values (Schweitzer) for a share `miss` of turns sent away to recompute, from queues
        `q_p`, `q_d`: (R, prefill, decode, a prefill engine's utilisation, q_p, q_d)."""
        s_prefill = service(miss)
        r = r_p = r_d = x = last = 0.0
        for _ in range(_ITERATIONS):
            r_p = s_prefill * (1.0 + q_p * shrink)
            seen = 1.0 + q_d * shrink
            running = min(seen, float(limit))
            r_d = out * step(running) * (seen / running)
            r = shape.tool_s + r_p + handoff + r_d
            x = n / r
            q_p += _DAMPING * (x / n_prefill * r_p - q_p)
            q_d += _DAMPING * (x / n_decode * r_d - q_d)
            if abs(r - last) <= _TOLERANCE * r:
                break
            last = r
        return r, r_p, r_d, x / n_prefill * s_prefill, q_p, q_d

    # A loop that is congested now — more prompts queued than each prefill engine's patience, so the shared queue
    # holds the rest — stays so while the misses congestion makes keep it there: every engine busy, turns meet
    # their engine's queue at its patience and a share sent_away(1) of them leaves, and the prefill engines' rate
    # at that share (`service`) is below what the rest of the loop (tool, handoff, decode) sends them with no
    # queue. That is the congested branch: the queue does not drain, turns are served at the engines' rate.
    # Otherwise the queue drains and the loop settles where it would from no misses (below). The branch is real:
    # 9:7 on 16 engines of deepseek-v3.2 at 821 live trajectories of 35k-token contexts held 245 queued prompts
    # for 150 s with 4.7 % of turns sent away (sent_away(1) at its patience: 4.9 %) and 13.7 s a turn; from no
    # misses the model put it at 10.8 s with an idle queue, and the policy held it against 10:6.
    if queued_prefills > n_prefill * (queue_patience or patience_prompts):
        saturated = elsewhere * sent_away(1.0, patience_prompts)
        r, r_p, r_d, _, _, _ = solve(saturated, 0.0, 0.0)
        s_sat = service(saturated)
        if n / (r - r_p + s_sat) >= n_prefill / s_sat:  # the loop sends more than the engines serve
            return TurnTime(r, n / r, r_p, r_d, handoff, shape.tool_s, congested=True)
    # The misses are the least fixed point of miss = elsewhere × sent_away(ρ(miss)), ρ(miss) the utilisation the
    # network settles at with that share of recomputes: the map is increasing (more recomputes, busier prefill
    # engines, more turns sent away) and bounded, so iterating it from no misses climbs to that point — the state
    # a loop that starts without misses reaches. (One damped iteration over misses and queues together cycled
    # near saturation — 5:3 at 503 live trajectories of 31k-token contexts swung between ρ 0.9 and 1.4 and
    # stopped wherever the iteration cap fell: 25.3 s a turn at 31k, 13.4 s at 40k.)
    miss = 0.0
    r, r_p, r_d, rho, q_p, q_d = solve(miss, 0.0, 0.0)
    for _ in range(_ITERATIONS):
        target = elsewhere * sent_away(rho, patience_prompts)
        if abs(target - miss) <= _TOLERANCE * max(miss, 1e-3):
            break
        miss = target
        r, r_p, r_d, rho, q_p, q_d = solve(miss, q_p, q_d)
    return TurnTime(r, n / r, r_p, r_d, handoff, shape.tool_s)


def _colocated(
    n_mixed: int,
    shape: TurnShape,
    n: float,
    cap: CapacityModel,
    max_waiting: float = MAX_WAITING,
    queued_prefills: float = 0.0,
    queued_tokens: float = 0.0,
) -> TurnTime:
    p = cap.profile
    ranks = p.dp_ranks
    hit_uncached = max(1.0, shape.new_tokens)
    # The same congested start as a split's (_disaggregated): a queue past placement's patience sends turns away
    # from their cache, and the share of misses is the one the queue holds now.
    ctx_in = max(hit_uncached, shape.context_tokens)
    miss_uncached = _miss_tokens(cap, hit_uncached, ctx_in)
    patience_prompts = turn_patience(shape, max_waiting)
    miss = _congested_miss_share(
        queued_prefills, queued_tokens, n_mixed, hit_uncached, miss_uncached, patience_prompts
    )
    away = 0.0 if miss is None else miss
    # A mixed engine caches each turn's prompt + answer in the KV its running decodes leave free
    # (`cache_hit_share`): the working set is every live trajectory homed here, the capacity shrinks as the
    # decode batch grows — colocation at high concurrency loses its caches to its own decodes (0.43 of prompt
    # tokens hit at 512 trajectories on qwen3-235b, against 0.88 at 4:4), a loss no split has.
    working_set = n / n_mixed * (shape.context_tokens + shape.output_tokens)
    ctx = _decode_context(shape)
    limit = cap.decode_batch_limit(ctx)
    step = _DecodeStep(cap, ctx)
    out = max(1.0, shape.output_tokens)
    shrink = max(0.0, (n - 1.0) / n)
    stalls: dict[int, tuple[float, float]] = {}

    def prompt_cost(lost: float) -> tuple[float, float]:
        """(stall, steps) of a prompt when a share `away` of turns is sent away (`_miss_tokens`) and a share `lost`
        finds its engine's cache has dropped its prefix (its whole context: LRU drops the trajectories that wait
        longest, not the shorter ones placement sends away). Each chunk makes its step dp_ranks × its compute
        longer (perf_model.mixed_step_time_s): over the prompt's chunks that adds up to dp_ranks × the prompt's
        compute, corrected online."""
        key = round(lost * 1000)  # the fixed point revisits the same shares: per-mille steps are kept
        hit = stalls.get(key)
        if hit is None:
            w = key / 1000
            uncached = (1.0 - away - w) * hit_uncached + away * miss_uncached + w * ctx_in
            cached = max(0.0, shape.context_tokens - uncached)
            stall = ranks * pm.prefill_compute_s(p, round(uncached), round(cached)) / cap.prefill_correction
            hit = stalls[key] = (stall, max(1.0, uncached / p.mixed_chunk_tokens))
        return hit

    q_p = q_d = 0.0
    r = r_p = r_d = 0.0
    x = last = 0.0
    for _ in range(_ITERATIONS):
        seen = 1.0 + q_d * shrink
        running = min(seen, float(limit))
        kept = cache_hit_share(p.kv_capacity_tokens - running * ctx, working_set)
        t_decode = step(running)
        hosted = (1.0 - away) * host_tier_share(p, working_set, kept)  # device misses host memory holds
        stall, steps = prompt_cost(max(0.0, (1.0 - away) * (1.0 - kept) - hosted))
        stall += hosted * host_reload_stall_s(p, shape.context_tokens, t_decode)
        s_prompt = stall + steps * t_decode  # time the prompt holds its rank
        t_mixed = t_decode + stall / steps  # one step that carries a chunk
        # Seidmann: a dp-server station ≈ one server dp times faster plus a delay of (dp − 1)/dp of the service.
        r_p = s_prompt / ranks * (1.0 + q_p * shrink) + s_prompt * (ranks - 1) / ranks
        busy = x / n_mixed * s_prompt  # ranks chunking, on average (Little)
        chunking = 1.0 - math.exp(-busy) if ranks > 1 else min(1.0, busy)  # share of the time
        # A sequence gains one token per step: tokens/s = chunking / t_mixed + (1 − chunking) / t_decode.
        per_token = 1.0 / (chunking / t_mixed + (1.0 - chunking) / t_decode)
        r_d = out * per_token * (seen / running)
        r = shape.tool_s + r_p + r_d
        x_new = n / r
        x = x_new if x == 0.0 else x + _DAMPING * (x_new - x)
        q_p += _DAMPING * (x / n_mixed * r_p - q_p)
        q_d += _DAMPING * (x / n_mixed * r_d - q_d)
        if abs(r - last) <= _TOLERANCE * r:
            break
        last = r
    return TurnTime(r, n / r, r_p, r_d, 0.0, shape.tool_s)


def projected_turns(steady: TurnTime, transit: TurnTime, switch_s: float, horizon_s: float) -> float:
    """Turns completed over `horizon_s` when the first `switch_s` run at `transit`'s rate, the rest at `steady`'s."""
    head = min(max(switch_s, 0.0), horizon_s)
    return transit.turns_per_s * head + steady.turns_per_s * (horizon_s - head)

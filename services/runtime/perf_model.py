"""Engine performance model: how long one serving instance takes to prefill, to run a decode step, to send KV.

Pure and deterministic: plain arithmetic on a `ModelProfile`; no clock, no randomness, no I/O. The simulator
(`prorsa.sim`) and the simulated engine backend call it; a real engine's calibration fits its coefficients
(`model_profiles.profile_to_json` documents the file). This is the one copy of every formula: the fast path the
simulator prices its steps with (`step_cost.StepCost`: the per-batch terms tabulated) is built from the functions
below and adds their terms in their order, and `tests/test_step_cost.py` checks that it equals them bit for bit.

It lives in the shared runtime, not in `services/engine_agent/`, because three parts need the same model: the
engine agent's simulated backend, the allocator's capacity model, and the simulator. Services may import only the
runtime and `proto`, never each other.

One *engine* is one serving instance: e.g. 8 GPUs at TP8, or a group of `dp_ranks` data-parallel attention ranks
sharing one expert-parallel MoE (DP attention). All rates below are for the whole engine.

Theory of operation (every time in seconds, every size in tokens):

* Attention layers come in two kinds. *Global* layers attend to the whole context; *local* layers attend to at
  most `attn_local_window_tokens` keys (a sliding window, or the top-k tokens a sparse-attention indexer selects).
  A query at position i attends to i keys in a global layer and min(i, W) in a local one.
* Prefill of `new` tokens on top of `cached` tokens already in the KV cache:
      prefill_overhead_s + new / prefill_tokens_per_s            (GEMMs: compute-bound, linear in new tokens)
      + attn_global_s_per_pair × pairs(new, cached, ∞)           (attention: grows with the cached context)
      + attn_local_s_per_pair  × pairs(new, cached, W)
  Cached tokens cost only through attention, so a hit is never dearer than computing the same tokens.
* One decode step of `batch` sequences holding `T` context tokens in total (each sequence produces one token):
      decode_overhead_s                                           (launches, collectives, scheduling)
      + weight_dense_read_s + weight_experts_read_s × touched(batch)   (weights streamed from HBM once per step;
        an MoE step reads only the experts its tokens route to: touched = 1 - (1 - k/E)^batch)
      + kv_global_read_s_per_token × T + kv_local_read_s_per_token × min(T, batch × W)   (KV reads)
      + decode_per_seq_s × batch                                  (per-token compute and sampling)
  so step time grows with both batch and total context.
* A *mixed* (chunked-prefill) step carries prefill tokens and every running decode together: it costs the decode
  step plus the prefill compute. With DP attention each request lives on one rank, and every rank joins the same
  MoE collective each step, so the step lasts as long as the slowest rank: a prefill chunk on one rank runs at
  1/dp_ranks of the engine's prefill rate and stalls the decode step of every rank (vllm-project/vllm pull 44558:
  P50 ITL 274.9 → 32.1 ms when prefill is limited to every second step; sgl-project/sglang pulls 35017, 23588).
* KV transfer between engines: `kv_transfer_latency_s + bytes / kv_transfer_bytes_per_s`.
* Host KV tier (optional, `host_kv_tokens` > 0): a prefix the device cache evicted but host memory still holds is
  reloaded over PCIe instead of recomputed, `bytes × dp_ranks / host_kv_load_bytes_per_s` per request, overlapped
  layer by layer with the step that starts the prompt (`host_reload_step_s`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

# Context length per sequence at which `decode_tokens_per_s_nominal` quotes an engine's decode capacity.
NOMINAL_DECODE_CONTEXT_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Every coefficient of the performance model for one engine (one serving instance).

    Sources and derivations of the built-in values are beside each profile in `model_profiles.py`.
    """

    name: str
    description: str
    gpus: int  # accelerators per engine (0 for a CPU engine)
    dp_ranks: int  # data-parallel attention ranks per engine; 1 = plain tensor parallelism
    max_batch: int  # most sequences in one decode batch (vLLM max_num_seqs)
    kv_capacity_tokens: int  # KV cache the engine holds, in tokens of context
    # Prefill (compute-bound).
    prefill_overhead_s: float  # fixed cost of one prefill step
    prefill_tokens_per_s: float  # linear part (GEMMs) over the whole engine, all ranks busy
    attn_global_s_per_pair: float  # attention cost per (query, key) pair summed over global layers
    attn_local_s_per_pair: float  # same, summed over local (windowed / top-k) layers
    attn_local_window_tokens: int  # keys a local layer attends to at most (0 = no local layers)
    prefill_batch_tokens: int  # new tokens one step of a prefill-role engine takes at most
    mixed_chunk_tokens: int  # chunked-prefill budget per rank and step in the mixed role
    # Decode (memory-bound at small batch).
    decode_overhead_s: float  # fixed cost of one decode step
    weight_dense_read_s: float  # streaming the non-expert weights once (s per step)
    weight_experts_read_s: (
        float  # streaming all routed experts once (s per step when every expert is touched)
    )
    experts_total: int  # routed experts per MoE layer (1 for a dense model or a fitted profile)
    experts_per_token: int  # experts each token routes to
    kv_global_read_s_per_token: float  # reading one context token's KV in global layers
    kv_local_read_s_per_token: float  # same for local layers (at most W tokens per sequence)
    decode_per_seq_s: float  # per-sequence compute + sampling within a step
    # Between engines and across roles.
    kv_transfer_bytes_per_token: float  # bytes sent per context token (global layers)
    kv_transfer_local_bytes_per_token: float  # bytes per token of the last W tokens (local layers)
    kv_transfer_bytes_per_s: float  # engine-to-engine KV bandwidth
    kv_transfer_latency_s: float  # fixed cost of one handoff (connector handshake, first-token round trip)
    # A role switch in place (same layout: kv_both engines need no restart): seconds from the command until the
    # engine pulls the new role's work; what it holds runs on meanwhile (services/engine_agent/switch_rule.py).
    role_switch_s: float
    # A restart: seconds an engine takes to start again (a switch to a role whose layout differs, once drained).
    # The default stands in for profile files that predate the field (assumption: a GPU engine's restart).
    engine_start_s: float = 60.0
    # The host-memory KV tier (SGLang HiCache's L2, vLLM + LMCache's CPU offload): tokens of prefix the engine keeps
    # in host DRAM beside its device cache; 0 = no tier (the default, so profiles without it do not move).
    # `services.runtime.host_kv.with_host_kv` sets both fields from HiCache's ratio, with their sources.
    host_kv_tokens: int = 0
    # Host-to-device bandwidth over the whole engine (bytes/s: every GPU's PCIe link); a request's reload runs over
    # its DP rank's share (`host_reload_time_s`). Must be > 0 when the tier is on.
    host_kv_load_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("profile name must not be empty")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"profile {self.name}: {f.name} must be >= 0, got {value}")
        positive: tuple[str, ...] = ("dp_ranks", "max_batch", "kv_capacity_tokens", "prefill_tokens_per_s")
        positive += ("prefill_batch_tokens", "mixed_chunk_tokens", "experts_total", "experts_per_token")
        positive += ("kv_transfer_bytes_per_s",)
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name}: {name} must be > 0, got {getattr(self, name)}")
        if self.experts_per_token > self.experts_total:
            raise ValueError(f"profile {self.name}: experts_per_token > experts_total")
        if self.host_kv_tokens > 0 and self.host_kv_load_bytes_per_s <= 0:
            raise ValueError(f"profile {self.name}: a host KV tier needs host_kv_load_bytes_per_s > 0")


def _pairs_before(position: float, window: float) -> float:
    """Σ_{i<position} min(i, window): keys attended by the queries at positions 0..position-1."""
    if position <= window:
        return position * (position - 1.0) / 2.0 if position > 0 else 0.0
    return window * (window - 1.0) / 2.0 + (position - window) * window


def attention_pairs(new_tokens: int, cached_tokens: int, window_tokens: float = math.inf) -> float:
    """(query, key) pairs computed when `new_tokens` follow `cached_tokens` in the context, keys capped at window."""
    if new_tokens <= 0:
        return 0.0
    if math.isinf(window_tokens):
        return new_tokens * cached_tokens + new_tokens * (new_tokens - 1) / 2.0
    end = float(cached_tokens + new_tokens)
    return _pairs_before(end, window_tokens) - _pairs_before(float(cached_tokens), window_tokens)


def prefill_compute_s(p: ModelProfile, new_tokens: int, cached_tokens: int = 0) -> float:
    """Compute time of a prefill chunk over the whole engine, without the per-step overhead."""
    if new_tokens <= 0:
        return 0.0
    linear = new_tokens / p.prefill_tokens_per_s
    attn = p.attn_global_s_per_pair * attention_pairs(new_tokens, cached_tokens)
    if p.attn_local_window_tokens > 0 and p.attn_local_s_per_pair > 0:
        local = attention_pairs(new_tokens, cached_tokens, p.attn_local_window_tokens)
        attn += p.attn_local_s_per_pair * local
    return linear + attn


def prefill_time_s(p: ModelProfile, new_tokens: int, cached_tokens: int = 0) -> float:
    """Seconds for one prefill step computing `new_tokens` after a `cached_tokens` prefix hit."""
    if new_tokens < 0 or cached_tokens < 0:
        raise ValueError(f"negative token count: new={new_tokens} cached={cached_tokens}")
    return p.prefill_overhead_s + prefill_compute_s(p, new_tokens, cached_tokens)


def prefill_step_time_s(p: ModelProfile, chunks: Sequence[tuple[int, int]]) -> float:
    """Seconds for one step of a prefill-role engine (no decodes) computing `chunks`, each (new tokens, cached
    tokens before it): the step's overhead plus every chunk's compute, summed in order."""
    compute_s = 0.0
    for new_tokens, cached_tokens in chunks:
        compute_s += prefill_compute_s(p, new_tokens, cached_tokens)
    return p.prefill_overhead_s + compute_s


def experts_touched_fraction(p: ModelProfile, batch: int) -> float:
    """Expected fraction of routed experts at least one of `batch` tokens routes to (uniform routing)."""
    if batch <= 0:
        return 0.0
    return 1.0 - (1.0 - p.experts_per_token / p.experts_total) ** batch


def decode_fixed_s(p: ModelProfile, batch: int) -> float:
    """The part of a decode step of `batch` sequences that does not grow with context: overhead + weight reads."""
    weights = p.weight_dense_read_s + p.weight_experts_read_s * experts_touched_fraction(p, batch)
    return p.decode_overhead_s + weights


def decode_per_seq_total_s(p: ModelProfile, batch: int) -> float:
    """Per-sequence compute and sampling of a decode step of `batch` sequences."""
    return p.decode_per_seq_s * batch


def decode_kv_read_s(p: ModelProfile, batch: int, total_context_tokens: int) -> float:
    """KV reads of a decode step of `batch` sequences holding `total_context_tokens` in all.

    Equal contexts assumed for the local layers: each sequence reads min(T / batch, W) of their tokens.
    """
    kv = p.kv_global_read_s_per_token * total_context_tokens
    window = p.attn_local_window_tokens
    if window > 0:  # min(T, batch × W), as a comparison: the simulator prices two of these per decode jump
        cap = batch * window
        kv += p.kv_local_read_s_per_token * (total_context_tokens if total_context_tokens < cap else cap)
    return kv


def decode_step_time_s(p: ModelProfile, batch: int, total_context_tokens: int) -> float:
    """Seconds for one decode step of `batch` sequences with `total_context_tokens` of KV among them:
    (`decode_fixed_s` + `decode_kv_read_s`) + `decode_per_seq_total_s`, summed in that order (the fast path,
    `step_cost.StepCost`, tabulates the per-batch terms and adds them in the same order: bit-identical).

    0 for an empty batch (nothing runs). Raises ValueError on negative inputs.
    """
    if batch < 0 or total_context_tokens < 0:
        raise ValueError(f"negative decode input: batch={batch} context={total_context_tokens}")
    if batch == 0:
        return 0.0
    fixed = decode_fixed_s(p, batch)
    return fixed + decode_kv_read_s(p, batch, total_context_tokens) + decode_per_seq_total_s(p, batch)


def slowest_rank_prefill_tokens(p: ModelProfile, prefill_tokens: int) -> int:
    """Prefill tokens on the busiest DP rank when a step carries `prefill_tokens` in all.

    A request's chunk lives on one rank, and a rank takes at most `mixed_chunk_tokens`, so small prefills land
    whole on one rank and large ones spread: max(⌈P / ranks⌉, min(P, chunk)).
    """
    if p.dp_ranks == 1 or prefill_tokens <= 0:
        return max(prefill_tokens, 0)
    spread = -(-prefill_tokens // p.dp_ranks)
    return max(spread, min(prefill_tokens, p.mixed_chunk_tokens))


def mixed_step_time_s(
    p: ModelProfile,
    prefill_tokens: int,
    decode_batch: int,
    decode_context_tokens: int,
    *,
    prefill_cached_tokens: int = 0,
    largest_rank_prefill_tokens: int | None = None,
) -> float:
    """Seconds for one chunked-prefill step carrying `prefill_tokens` and a decode batch.

    Never less than the pure decode step. With DP attention the step waits for the rank that carries the most
    prefill (`largest_rank_prefill_tokens`, or `slowest_rank_prefill_tokens`' estimate), and that rank computes at
    1/dp_ranks of the engine's rate. `prefill_cached_tokens` is the context before the chunk (attention cost).
    """
    if prefill_tokens < 0 or prefill_cached_tokens < 0:
        raise ValueError(f"negative prefill input: {prefill_tokens}, cached {prefill_cached_tokens}")
    decode = decode_step_time_s(p, decode_batch, decode_context_tokens)
    return mixed_step_from_decode_s(
        p, decode, decode_batch, prefill_tokens, prefill_cached_tokens, largest_rank_prefill_tokens
    )


def mixed_step_from_decode_s(
    p: ModelProfile,
    decode_s: float,
    decode_batch: int,
    prefill_tokens: int,
    prefill_cached_tokens: int,
    largest_rank_prefill_tokens: int | None,
) -> float:
    """`mixed_step_time_s` given its decode step's time `decode_s` (of `decode_batch` sequences), for a caller
    that has priced the decode step already (the fast path's tables). Inputs are not validated."""
    if prefill_tokens == 0:
        return decode_s
    base = decode_s if decode_batch > 0 else p.prefill_overhead_s
    if p.dp_ranks == 1:
        return base + prefill_compute_s(p, prefill_tokens, prefill_cached_tokens)
    rank_tokens = largest_rank_prefill_tokens
    if rank_tokens is None:
        rank_tokens = slowest_rank_prefill_tokens(p, prefill_tokens)
    rank_tokens = min(max(rank_tokens, 0), prefill_tokens)
    return base + p.dp_ranks * prefill_compute_s(p, rank_tokens, prefill_cached_tokens)


def mixed_step_shape(p: ModelProfile, chunks: Sequence[tuple[int, int]]) -> tuple[int, int, int]:
    """(prefill tokens, cached tokens, largest rank's prefill tokens) with which `mixed_step_time_s` prices a
    chunked-prefill step carrying `chunks`, each (new tokens, cached tokens before it; at least one chunk).

    Each chunk lives on one rank; with more chunks than ranks the busiest rank holds at least an even share. With
    one rank, attention is priced at the token-weighted mean context before the chunks; with DP attention, at the
    context of the biggest chunk (the first of the biggest), whose rank the step waits for.
    """
    total = 0
    for new_tokens, _ in chunks:
        total += new_tokens
    biggest, biggest_cached = max(chunks, key=_chunk_tokens)
    ranks = p.dp_ranks
    largest = biggest if len(chunks) <= ranks else max(biggest, -(-total // ranks))
    if ranks == 1:
        cached = 0
        for new_tokens, cached_tokens in chunks:
            cached += cached_tokens * new_tokens
        return total, cached // max(total, 1), largest
    return total, biggest_cached, largest


def _chunk_tokens(chunk: tuple[int, int]) -> int:
    return chunk[0]


def kv_transfer_bytes(p: ModelProfile, tokens: int) -> float:
    """Bytes moved to hand `tokens` of context from one engine to another."""
    if tokens < 0:
        raise ValueError(f"negative token count: {tokens}")
    window = p.attn_local_window_tokens
    local = (tokens if tokens < window else window) * p.kv_transfer_local_bytes_per_token  # min(tokens, W)
    return tokens * p.kv_transfer_bytes_per_token + local


def kv_transfer_time_s(p: ModelProfile, tokens: int) -> float:
    """Seconds to send the KV of `tokens` context tokens between engines (0 tokens: nothing to send)."""
    if tokens == 0:
        return 0.0
    return p.kv_transfer_latency_s + kv_transfer_bytes(p, tokens) / p.kv_transfer_bytes_per_s


def host_reload_time_s(p: ModelProfile, tokens: int) -> float:
    """Seconds to load `tokens` of one request's context from the host KV tier onto its GPUs: its KV bytes (as a
    handoff moves them, `kv_transfer_bytes`) over the PCIe links of its DP rank, 1/dp_ranks of the engine's
    (with DP attention a request's KV lives on its rank alone). 0 for no tokens; raises ValueError without a tier."""
    if tokens <= 0:
        return 0.0
    if p.host_kv_load_bytes_per_s <= 0:
        raise ValueError(f"profile {p.name} has no host KV tier to reload from")
    return kv_transfer_bytes(p, tokens) * p.dp_ranks / p.host_kv_load_bytes_per_s


def host_reload_step_s(p: ModelProfile, reload_tokens: Sequence[int]) -> float:
    """Seconds the host-tier reloads of the prompts one step starts take, `reload_tokens` each: every request over
    its own rank's links, the ranks in parallel, so the largest one or an even share of all of them over every
    link, whichever is longer (one rank: their sum). The step lasts the longer of this and its compute: HiCache
    loads layer N+1 while layer N computes (layer-wise overlap), so only a load longer than the step stalls it."""
    largest = 0.0
    total = 0.0
    for tokens in reload_tokens:
        if tokens > 0:
            moved = kv_transfer_bytes(p, tokens)
            total += moved
            if moved > largest:
                largest = moved
    if total <= 0:
        return 0.0
    if p.host_kv_load_bytes_per_s <= 0:
        raise ValueError(f"profile {p.name} has no host KV tier to reload from")
    busiest = largest * p.dp_ranks if largest * p.dp_ranks > total else total
    return busiest / p.host_kv_load_bytes_per_s


def kv_capacity_tokens(p: ModelProfile) -> int:
    """Context tokens the engine's KV cache holds."""
    return p.kv_capacity_tokens


def role_switch_time_s(p: ModelProfile) -> float:
    """Seconds an in-place role switch keeps an engine from pulling (its held work runs on)."""
    return p.role_switch_s


def engine_start_time_s(p: ModelProfile) -> float:
    """Seconds a restarted engine (a switch to another layout, once drained) takes to serve again."""
    return p.engine_start_s


def decode_tokens_per_s_nominal(
    p: ModelProfile, context_per_seq_tokens: int = NOMINAL_DECODE_CONTEXT_TOKENS
) -> float:
    """Output tokens/s of a full decode batch at `context_per_seq_tokens` each (capacity for plots and views)."""
    context = max(context_per_seq_tokens, 1)
    batch = max(1, min(p.max_batch, p.kv_capacity_tokens // context))
    return batch / decode_step_time_s(p, batch, batch * context)

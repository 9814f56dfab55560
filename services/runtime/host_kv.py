"""The host-memory KV tier as an engine option: its size and reload bandwidth, from public figures.

Production engines keep prefixes their GPUs evicted in host DRAM and load them back over PCIe instead of
recomputing them: SGLang's HiCache (GPU memory = L1, host memory = L2, private to each instance;
sgl-project/sglang:docs/advanced_features/hicache_design.md), vLLM with LMCache's CPU offload or its native
OffloadingConnector (an LRU pool of CPU blocks; LMCache/LMCache README: 3–10× delay savings on multi-round QA and
RAG), Mooncake's store as HiCache's L3. The model of it (`services.engine_agent.prefix_cache`, `perf_model`):

* size: HiCache's `--hicache-ratio`, the host pool over the device pool, 2.0 by default
  (sgl-project/sglang:python/sglang/srt/server_args.py, `hicache_ratio = 2.0`); the host pool must be larger than
  the device pool (python/sglang/srt/mem_cache/memory_pool_host.py asserts it: "The host memory should be larger
  than the device memory with the current protocol"), because the tier is inclusive — the default write policy is
  `write_through` (server_args.py), every prefix the GPU caches is backed up to host memory as it is cached, so
  what the GPU evicts is already there. Host memory of the node bounds it: a DGX H200 has 2 TB
  (mlcommons/inference_results_v4.1:closed/NVIDIA/systems/H200-SXM-141GBx8_TRT_MaxQ.json, "host_memory_capacity":
  "2 TB"); at ratio 2 qwen3-235b's 1.94M device tokens × 385 KB = 0.75 TB become 1.5 TB of host pool,
  deepseek-v3.2's 3.7M × 78 KB = 0.29 TB become 0.58 TB: both fit.
* bandwidth: each GPU loads its share of a request's KV over its own PCIe Gen5 x16 link. Measured host→device
  copy-engine bandwidth on H100: ~57 GB/s per GPU (NVIDIA/nvbandwidth issue 6: 57.06, 56.68, 57.07 GB/s); the
  H200 system above lists "PCIe Gen5 x16" per GPU and 504 GB/s GPU–PCIe over 8 GPUs (63 GB/s each). We take
  55 GB/s per GPU, a little under the single-GPU measurement because all eight load at once from two sockets.
  A TP engine spreads each request's KV over all its GPUs (the whole engine's links); with DP attention a request
  lives on one rank, so its reload gets that rank's links only (`perf_model.host_reload_time_s`).
* overlap: HiCache loads the KV of layer N+1 while layer N computes ("Compute-Transfer Overlap", hicache_design.md;
  the layer-wise overlap of arXiv 2403.19708, lm-sys/lm-sys.github.io:blog/2025-09-10-sglang-hicache.md), so a
  reload costs only what it takes beyond the step that starts the prompt (`perf_model.host_reload_step_s`).
  Write-through copies go device→host, the other direction of the full-duplex link: not charged.

What is left out: HiCache's L3 (remote stores), pages (64 tokens) instead of tokens, and the write bandwidth a
write-through tier takes from a busy link in the same direction as handoffs (none: handoffs go over RDMA NICs).
"""

from __future__ import annotations

from dataclasses import replace

from services.runtime.perf_model import ModelProfile

# HiCache's default ratio of host pool to device pool (sgl-project/sglang:python/sglang/srt/server_args.py).
HICACHE_DEFAULT_RATIO = 2.0
# Host→device bytes/s per GPU over PCIe Gen5 x16 with every GPU loading (module doc: 57 GB/s measured for one
# H100, NVIDIA/nvbandwidth issue 6; 63 GB/s per GPU listed for the 8×H200 MLCommons system).
PCIE_H2D_BYTES_PER_S_PER_GPU = 55e9


def with_host_kv(profile: ModelProfile, ratio: float, load_bytes_per_s: float | None = None) -> ModelProfile:
    """`profile` with a host KV tier of `ratio` × its device KV capacity (HiCache's `--hicache-ratio`; 0 = no tier:
    `profile` itself, unchanged). The reload bandwidth is `load_bytes_per_s`, else the profile's own, else
    `PCIE_H2D_BYTES_PER_S_PER_GPU` × its GPUs.

    Raises ValueError for a negative ratio, a ratio in (0, 1] (the tier is inclusive: SGLang refuses a host pool no
    larger than the device pool), or a CPU engine (its KV is in host memory already).
    """
    if ratio == 0:
        return profile
    if not ratio > 1.0:  # also rejects NaN
        raise ValueError(
            f"host KV ratio must be 0 (off) or > 1 (the host tier holds what the GPU does), got {ratio}"
        )
    if profile.gpus <= 0:
        raise ValueError(
            f"profile {profile.name}: a CPU engine has no host KV tier (its KV is in host memory)"
        )
    bandwidth = (
        load_bytes_per_s or profile.host_kv_load_bytes_per_s or profile.gpus * PCIE_H2D_BYTES_PER_S_PER_GPU
    )
    if bandwidth <= 0:
        raise ValueError(f"host KV load bandwidth must be > 0, got {bandwidth}")
    return replace(
        profile,
        host_kv_tokens=int(ratio * profile.kv_capacity_tokens),
        host_kv_load_bytes_per_s=float(bandwidth),
    )

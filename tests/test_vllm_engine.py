"""The vLLM backend's pure parts, without vLLM: seeds, environment handling, output conversion, stats, and the
protocol paths that never reach the engine (nothing left to generate, an expired KV lease)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace

import msgspec
import pytest

from proto import DecodeHandoff, GenerateRequest, SamplingParams
from services.engine_agent.backend import Backend, BackendError, KvUnavailable
from services.engine_agent.backends.vllm_backend import VllmBackend
from services.engine_agent.backends.vllm_chunks import StreamState
from services.engine_agent.backends.vllm_engine import (
    VllmEngine,
    VllmEngineConfig,
    _engine_env,
    _environment,
    _vllm_errors,
    request_seed,
)
from services.engine_agent.backends.vllm_stats import EngineStatsBox
from services.runtime.clock import Clock

CONFIG = VllmEngineConfig(model_path="/nonexistent", engine_id="e1", nixl_port=5601, max_model_len=100)


def _request(prompt_len: int, max_tokens: int, resume: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(
        request_id="t:0",
        traj_id="t",
        turn=0,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        prompt_len=prompt_len,
        sampling=SamplingParams(max_tokens=max_tokens),
        reply_to="r",
        resume_token_ids=resume or [],
    )


def test_request_seed_is_stable_distinct_and_fits_int63() -> None:
    assert request_seed("a:1") == request_seed("a:1")
    assert request_seed("a:1") != request_seed("a:2")
    assert all(0 <= request_seed(f"r{i}") < 2**63 for i in range(100))


def test_environment_sets_unsets_and_restores() -> None:
    os.environ["PRORSA_T_KEEP"] = "old"
    os.environ.pop("PRORSA_T_NEW", None)
    with _environment({"PRORSA_T_KEEP": None, "PRORSA_T_NEW": "1"}):
        assert "PRORSA_T_KEEP" not in os.environ
        assert os.environ["PRORSA_T_NEW"] == "1"
    assert os.environ.pop("PRORSA_T_KEEP") == "old"
    assert "PRORSA_T_NEW" not in os.environ


@pytest.mark.parametrize(("is_cpu", "threads", "omp"), [(True, 1, "1"), (True, None, None), (False, 1, None)])
def test_engine_env(is_cpu: bool, threads: int | None, omp: str | None) -> None:
    env = _engine_env(
        VllmEngineConfig(model_path="m", engine_id="e", nixl_port=5777, cpu_threads=threads), is_cpu
    )
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5777"
    # CPU workarounds on CPU only (a GPU engine runs vLLM's own executor; see test_engine_args)
    assert env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == ("0" if is_cpu else None)
    if is_cpu:
        assert env["VLLM_CPU_KVCACHE_SPACE"] is None  # kv_cache_bytes wins over the legacy variable
    assert env.get("OMP_NUM_THREADS") == omp


def _output(tokens: list[int], *, finished: bool = False, cached: int | None = 0, kv: dict | None = None):
    logprobs = [{t: SimpleNamespace(logprob=-0.5 * (i + 1))} for i, t in enumerate(tokens)]
    completion = SimpleNamespace(
        token_ids=tokens, logprobs=logprobs, finish_reason="length" if finished else None
    )
    return SimpleNamespace(
        outputs=[completion], finished=finished, num_cached_tokens=cached, kv_transfer_params=kv
    )


def test_stream_state_turns_outputs_into_chunks() -> None:
    state = StreamState("r1", num_prompt_tokens=300)
    first = state.chunk(_output([5], cached=256), elapsed_s=0.2)
    assert (first.token_ids, first.logprobs, first.ttft_s, first.num_cached_tokens) == ([5], [-0.5], 0.2, 256)
    assert not first.finished and first.finish_reason == "" and first.kv_transfer_params is None
    kv = {"remote_block_ids": ((1, 2),), "remote_engine_id": "a"}
    last = state.chunk(_output([6, 7], finished=True, cached=None, kv=kv), elapsed_s=0.5)
    assert last.logprobs == [-0.5, -1.0] and last.num_output_tokens == 3 and last.ttft_s == 0.2
    assert last.finished and last.finish_reason == "length" and last.num_cached_tokens == 256
    assert last.kv_transfer_params == {"remote_block_ids": [[1, 2]], "remote_engine_id": "a"}
    aborted = state.final("abort", elapsed_s=0.6)
    assert aborted.finished and aborted.finish_reason == "abort" and aborted.token_ids == []


def test_stream_state_keeps_the_top_k_by_vllms_rank() -> None:
    """vLLM's `logprobs=k` gives each position the top k by rank plus the sampled token at its own rank when it
    ranks lower: the alternatives are the k best, in rank order, whether or not the sampled one is among them."""
    lp = SimpleNamespace
    sampled_in = {7: lp(logprob=-0.2, rank=1), 9: lp(logprob=-2.0, rank=2)}  # 7 sampled, ranked first
    sampled_out = {3: lp(logprob=-4.0, rank=17), 8: lp(logprob=-0.1, rank=1), 1: lp(logprob=-3.0, rank=2)}
    completion = SimpleNamespace(token_ids=[7, 3], logprobs=[sampled_in, sampled_out], finish_reason=None)
    out = SimpleNamespace(outputs=[completion], finished=False, num_cached_tokens=0, kv_transfer_params=None)
    chunk = StreamState("r", 10, top_logprobs=2).chunk(out, elapsed_s=0.1)
    assert chunk.logprobs == [-0.2, -4.0]  # the sampled tokens' own
    assert chunk.top_logprobs == [[(7, -0.2), (9, -2.0)], [(8, -0.1), (1, -3.0)]]
    assert StreamState("r", 10).chunk(out, elapsed_s=0.1).top_logprobs is None  # not asked for


def test_vllm_backend_maps_the_sampling_and_refuses_what_its_engine_cannot_return() -> None:
    backend = VllmBackend(CONFIG)
    sampling = SamplingParams(
        max_tokens=20, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.2, min_tokens=8
    )
    req = msgspec.structs.replace(_request(10, 20, resume=[4, 5, 6]), sampling=sampling)
    kw = backend._sampling(req)
    assert (kw["presence_penalty"], kw["frequency_penalty"], kw["repetition_penalty"]) == (0.5, 0.25, 1.2)
    assert kw["min_tokens"] == 5  # 3 of the 8 were streamed before the migration
    assert backend.sampling_problem(SamplingParams(max_tokens=5, logprobs_mode="raw_logprobs")) == ""
    assert backend.sampling_problem(SamplingParams(max_tokens=5, top_logprobs=20)) == ""
    refused = backend.sampling_problem(SamplingParams(max_tokens=5, logprobs_mode="processed_logprobs"))
    assert "processed_logprobs" in refused and "raw_logprobs" in refused
    backend.engine.max_logprobs = 5  # as an engine started with --engine-arg max_logprobs=5 resolves it
    assert "max_logprobs 5" in backend.sampling_problem(SamplingParams(max_tokens=5, top_logprobs=6))


def test_vllm_sampling_params_take_penalties_min_tokens_and_top_k() -> None:
    pytest.importorskip("vllm", reason="vLLM's SamplingParams")
    params = VllmEngine._sampling(
        max_tokens=1, temperature=1.0, top_p=1.0, top_k=-1, seed=1, logprobs=True, stop_token_ids=None,
        ignore_eos=False, repetition_penalty=1.3, presence_penalty=-0.5, min_tokens=8, top_logprobs=4,
    )  # fmt: skip
    assert (params.min_tokens, params.logprobs) == (1, 4)  # a prefill's one token: min_tokens capped by it
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.3, -0.5, 0.0)
    plain = VllmEngine._sampling(
        max_tokens=9, temperature=1.0, top_p=1.0, top_k=-1, seed=None, logprobs=True, stop_token_ids=None,
        ignore_eos=False,
    )  # fmt: skip
    assert (plain.logprobs, plain.min_tokens, plain.repetition_penalty) == (0, 0, 1.0)


def test_stats_box_accumulates_and_reports_idle_as_zero() -> None:
    box = EngineStatsBox()
    sched = SimpleNamespace(
        num_running_reqs=3,
        num_waiting_reqs=1,
        num_skipped_waiting_reqs=1,
        kv_cache_usage=0.25,
        prefix_cache_stats=SimpleNamespace(queries=300, hits=256),
        connector_prefix_cache_stats=SimpleNamespace(hits=128),
    )
    it = SimpleNamespace(num_prompt_tokens=44, num_generation_tokens=3, num_preempted_reqs=0)
    box.record(sched, it)
    box.record(sched, None)
    busy = box.snapshot(unfinished=5, kv_capacity_tokens=1000, max_batch=8, start_s=20.0)
    assert (busy.running, busy.waiting, busy.kv_usage) == (3, 2, 0.25)
    assert (busy.prefix_query_tokens, busy.prefix_hit_tokens, busy.kv_pulled_tokens) == (600, 512, 256)
    assert (busy.prompt_tokens, busy.generation_tokens) == (44, 3)
    idle = box.snapshot(unfinished=0, kv_capacity_tokens=1000, max_batch=8, start_s=20.0)
    assert (idle.running, idle.waiting) == (0, 0)


def test_vllm_backend_satisfies_the_protocol_and_caps_output_by_model_length() -> None:
    backend = VllmBackend(CONFIG)
    assert isinstance(backend, Backend)
    assert backend.expected_output_tokens(_request(90, 50)) == 10
    assert backend.expected_output_tokens(_request(10, 50)) == 50


async def test_generate_with_nothing_left_finishes_without_the_engine() -> None:
    backend = VllmBackend(CONFIG)  # never started: reaching the engine would raise
    chunks = [c async for c in backend.generate(_request(100, 50))]
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].finish_reason == "length"


async def test_decode_refuses_a_handoff_past_the_kv_lease() -> None:
    backend = VllmBackend(CONFIG)
    stale = DecodeHandoff(
        request=_request(10, 20),
        prefill_engine="p",
        first_token_id=3,
        kv_transfer_params={"remote_engine_id": "p"},
        handed_off_s=time.time() - CONFIG.kv_lease_s,
    )
    with pytest.raises(KvUnavailable):
        async for _ in backend.decode(stale):
            pass


async def test_the_kv_lease_is_read_on_the_shared_clock_when_it_is_compressed() -> None:
    """Handoffs are stamped on the scaled clock; the lease is vLLM's, in wall seconds. At 10 virtual seconds per
    wall second a handoff stamped a lease of wall time ago is stale, and one stamped half a lease ago is not."""
    clock = Clock(10.0)
    backend = VllmBackend(CONFIG, clock=clock)

    def handoff(age_wall_s: float) -> DecodeHandoff:
        return DecodeHandoff(
            request=_request(10, 20),
            prefill_engine="p",
            first_token_id=3,
            kv_transfer_params={"remote_engine_id": "p"},
            handed_off_s=clock.now_s() - age_wall_s * clock.time_scale,
        )

    with pytest.raises(KvUnavailable):
        backend._check_lease(handoff(CONFIG.kv_lease_s))
    backend._check_lease(handoff(0.5 * CONFIG.kv_lease_s))  # within the lease's safe part: no error


class _FailingLlm:
    """An AsyncLLM whose every call raises `exc` (its engine core alive: `errored` False)."""

    errored = False

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.aborted: list[str] = []  # the request ids abort was asked for

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        raise self.exc

    async def pause_generation(self, **kw: object) -> None:
        raise self.exc


@pytest.fixture
def without_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's own error classes unimportable (as where it is not installed): no slow import of vLLM here."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    _vllm_errors.cache_clear()
    yield
    _vllm_errors.cache_clear()  # a later caller imports the real classes


@pytest.mark.parametrize("call", ["abort", "reload"])
async def test_engine_failures_become_backend_errors_and_our_bugs_propagate(
    call: str, without_vllm: None
) -> None:
    engine = VllmEngine(CONFIG)

    async def run(exc: Exception) -> None:
        engine._llm = _FailingLlm(exc)
        await (engine.abort("r") if call == "abort" else engine.reload_weights())

    for engine_failure in (OSError("socket gone"), ValueError("refused"), RuntimeError("engine core died")):
        with pytest.raises(BackendError) as info:
            await run(engine_failure)
        assert info.value.__cause__ is engine_failure
    with pytest.raises(TypeError):  # our bug: not disguised as the engine's
        await run(TypeError("our bug"))
    engine._llm = None


async def test_abort_on_a_dead_engine_is_a_no_op(without_vllm: None) -> None:
    engine = VllmEngine(CONFIG)
    dead = _FailingLlm(RuntimeError("engine core died"))
    dead.errored = True  # as AsyncLLM says once its engine core process is gone
    engine._llm = dead
    # It returns (an exception here would stop the agent's hand-on of its jobs) without asking the dead engine:
    # nothing is left to abort.
    await engine.abort("r")
    assert dead.aborted == []

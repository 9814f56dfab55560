"""One real vLLM engine (`AsyncLLM`) with token ids in and out, and KV handed between engines by NIXL.

This is the token-level layer; `vllm_backend.VllmBackend` adapts it to the agent's `Backend` protocol.

Theory of operation (vLLM 0.32, read from its sources):
- `AsyncLLM` keeps the engine core in a child process (always, for the async client); this process runs the
  output handler as a task of the event loop that first submits a request, so an engine belongs to one loop.
  Building it blocks for the child's start (it re-imports vLLM: ~15-25 s on a 2-core CPU machine), so `start()`
  builds it in a worker thread and the loop keeps serving.
- Disaggregation uses the NIXL connector in `kv_both` role, so every engine can prefill for others and decode
  for others without a restart. A prefill for remote decode is a request with `max_tokens=1` and
  `SamplingParams.extra_args["kv_transfer_params"] = {"do_remote_decode": True}`; its final output carries the
  `kv_transfer_params` (remote engine id, block ids, side-channel host/port, ...) that a decode engine passes, in
  the same `extra_args` slot, with the same prompt. The decode engine pulls the prompt's KV (one-sided NIXL read
  after a ZMQ handshake with the prefill engine's side channel), recomputes the last prompt token and samples the
  first output token again: that token equals the prefill engine's only if both draw it the same way, so a
  prefill/decode pair always samples with a seed (the caller's, else one derived from the request id).
- The prefill engine holds the handed-off blocks for `kv_lease_s` unless the decode engine accepted the request
  (it then renews the lease by heartbeats and frees the blocks once read). A decode that starts after the lease
  expired could read reused blocks, so callers must not start one that late (the backend checks the age).
- A failed KV pull ends the decode request with finish reason "error" (`kv_load_failure_policy="fail"`).
- Per-process settings that vLLM only reads from the environment (NIXL side-channel port, worker placement,
  OpenMP threads) are set while the engine's child process is spawned, under a lock, then restored.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from services.engine_agent.backend import BackendError, EngineDead, KvUnavailable, RequestAborted
from services.engine_agent.backends import vllm_weights
from services.engine_agent.backends.vllm_chunks import EngineChunk, StreamState
from services.engine_agent.backends.vllm_launch import (
    CPU_MAX_MODEL_LEN,
    VllmEngineConfig,  # the engine's configuration, imported from here by its users
    _engine_args,
    _engine_env,
    _environment,
)
from services.engine_agent.backends.vllm_stats import (
    EngineStatsBox,
    VllmEngineStats,
    make_stat_logger_factory,
)

log = logging.getLogger(__name__)

# The environment is process-wide and an engine's child process copies it when spawned, inside the build: the
# lock is held for the whole build, so engines of one process start one after the other.
_ENV_LOCK = threading.Lock()
_WARMUP_PROMPT_TOKENS = 300
# The key in a handoff's kv_transfer_params that carries the prefill engine's `VllmEngine.compat`.
COMPAT_KEY = "prorsa_compat"


async def _in_daemon_thread(fn: Any) -> Any:
    """`fn()` in a daemon thread: unlike `asyncio.to_thread`, a build abandoned at a time-out does not hold the
    interpreter's exit (the default executor's threads are joined at shutdown)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting task, which re-raises it
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=run, name="vllm-build", daemon=True).start()
    return await future


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return  # timed out: the caller has gone
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


@functools.cache
def _vllm_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises when an engine fails to start or fails a request for reasons of its own, which this module
    turns into BackendError: its own error classes, ValueError (a config or request it refuses; pydantic's
    ValidationError is one), RuntimeError (a dead engine core; torch's out-of-memory error is one), OSError (model
    files, ports) and ImportError (vLLM or NIXL missing). Anything else is our bug here and propagates as is."""
    found: list[type[Exception]] = [ValueError, RuntimeError, OSError, ImportError]
    try:
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        found += [EngineDeadError, EngineGenerateError]
        from vllm.exceptions import VLLMError  # newer vLLM: the base of all its errors (validation included)

        found.append(VLLMError)
    except ImportError:  # no vLLM, or one older than these classes
        pass
    return tuple(found)


@dataclass(frozen=True, slots=True)
class PrefillHandoff:
    """A prompt prefilled for a remote decode: the first token and where its KV can be pulled from."""

    first_token_id: int
    first_logprob: float | None
    first_top_logprobs: list[tuple[int, float]] | None  # its k most likely alternatives (top_logprobs > 0)
    kv_transfer_params: dict[str, Any]  # give verbatim to `decode_from_remote` on the decode engine
    seed: int  # the sampling seed used; the decode engine must use the same one
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from this engine's prefix cache
    prefill_s: float  # submit -> first token
    finish_reason: (
        str  # "length" (max_tokens=1) or "stop" (the first token is a stop token: nothing to decode)
    )
    policy_version: int | None = None  # the weights version that sampled the first token (vLLM's label)


def request_seed(request_id: str) -> int:
    """A stable sampling seed for a request (the prefill and decode engines must draw the first token alike)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big") >> 1


class VllmEngine:
    """One `AsyncLLM` engine: start/stop/restart, token-level generation, prefill/decode across engines."""

    def __init__(self, config: VllmEngineConfig) -> None:
        self.config = config
        self.start_s: float | None = None  # how long the last start took
        # vLLM's resolved values, known once started (the user's engine arguments may have set any of them):
        self.kv_capacity_tokens = 0  # over every data-parallel rank (vLLM sums their blocks)
        self.max_num_batched_tokens = 0  # prefill tokens per engine step at most
        self.max_model_len = config.max_model_len or CPU_MAX_MODEL_LEN
        self.max_num_seqs = config.max_num_seqs  # per data-parallel rank
        self.dp_size = 1  # data-parallel ranks behind this AsyncLLM
        # What two engines must share for one to read the other's KV (checked on every handoff, before NIXL's
        # own handshake would fail it): vLLM version, model, dtype, block size, tensor parallelism.
        self.compat = ""
        # The logprobs it returns (vLLM's engine-wide `logprobs_mode`) and the most top-k alternatives a request
        # may ask for (`max_logprobs`): vLLM's defaults until started.
        self.logprobs_mode = "raw_logprobs"
        self.max_logprobs = 20
        self._llm: Any = None  # vllm.v1.engine.async_llm.AsyncLLM
        self._stats = EngineStatsBox()
        self._transfer_ready = False  # joined the trainer's weight-transfer group

    # -- lifecycle -----------------------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._llm is not None

    async def start(self, timeout_s: float | None = None) -> float:
        """Build the engine (in a worker thread); return the seconds it took. Raises BackendError on failure, or
        when the build has not finished within `timeout_s` (wall; None: no limit; the build then runs on in its
        daemon thread, so the caller should leave the process: nothing can cancel vLLM's start-up)."""
        if self._llm is not None:
            return 0.0
        t0 = time.perf_counter()
        try:
            self._llm = await asyncio.wait_for(_in_daemon_thread(self._build), timeout_s)
        except TimeoutError:
            raise BackendError(
                f"vLLM engine {self.config.engine_id} did not start within {timeout_s:.0f} s"
            ) from None
        except _vllm_errors() as exc:
            raise BackendError(f"vLLM engine {self.config.engine_id} failed to start: {exc}") from exc
        self._resolve(self._llm.vllm_config)
        build_s = time.perf_counter() - t0
        try:
            await self._warm_up()
        except BaseException:
            await self.stop()
            raise
        self.start_s = time.perf_counter() - t0
        log.info(
            "vLLM engine %s started in %.1f s (build %.1f s); KV side channel %s:%d (+ rank); compatibility %s",
            self.config.engine_id,
            self.start_s,
            build_s,
            self.config.nixl_host,
            self.config.nixl_port,
            self.compat,
        )
        return self.start_s

    def _resolve(self, vc: Any) -> None:
        """Read what vLLM resolved from our defaults and the user's engine arguments."""
        cache, parallel = vc.cache_config, vc.parallel_config
        self.kv_capacity_tokens = int(cache.num_gpu_blocks or 0) * int(cache.block_size)
        self.max_num_batched_tokens = int(vc.scheduler_config.max_num_batched_tokens)
        self.max_model_len = int(vc.model_config.max_model_len)
        self.max_num_seqs = int(vc.scheduler_config.max_num_seqs)
        self.dp_size = int(parallel.data_parallel_size)
        self.logprobs_mode = str(vc.model_config.logprobs_mode)
        self.max_logprobs = int(vc.model_config.max_logprobs)
        import vllm

        parts = (
            vllm.__version__,
            os.path.basename(os.path.normpath(self.config.model_path)),
            str(vc.model_config.dtype),
            str(cache.block_size),
            str(parallel.tensor_parallel_size),
        )
        self.compat = hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()

    @property
    def max_batch(self) -> int:
        """Sequences the engine batches at once over every data-parallel rank."""
        return self.max_num_seqs * self.dp_size

    def dp_rank_for(self, key: str) -> int | None:
        """The data-parallel rank a trajectory's turns go to (None: one rank). Stable per key, so every turn of a
        trajectory lands on the rank whose prefix cache holds its history (vLLM would otherwise pick its least
        loaded rank for each turn anew)."""
        if self.dp_size <= 1 or not key:
            return None
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") % self.dp_size

    async def check_alive(self) -> None:
        """Raises EngineDead once the engine core has died (vLLM's `check_health`); returns otherwise, and
        before start."""
        llm = self._llm
        if llm is None:
            return
        try:
            await llm.check_health()
        except _vllm_errors() as exc:
            raise EngineDead(f"vLLM engine {self.config.engine_id} is dead: {exc!r}") from exc

    def _dead(self) -> bool:
        return self._llm is not None and bool(self._llm.errored)

    async def _warm_up(self) -> None:
        # The first request down each sampling path (greedy, seeded, unseeded; with logprobs) pays a one-off
        # cost (measured 5-10 s on a loaded 2-core CPU): pay it here so that `start()` returns an engine serving
        # at full speed. The blocks are then dropped from the prefix cache and the counts from the stats, so the
        # warm-up leaves no trace.
        prompt = [(1 + 37 * i) % 1000 + 1 for i in range(_WARMUP_PROMPT_TOKENS)]
        for temperature, seed in ((0.0, None), (1.0, 0), (1.0, None)):
            async for _ in self.generate("__warmup__", prompt, 2, temperature=temperature, seed=seed):
                pass
        await self._engine().reset_prefix_cache()
        self._stats.reset()

    def _build(self) -> Any:
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        is_cpu = current_platform.is_cpu()
        args = _engine_args(self.config, is_cpu)
        with _ENV_LOCK, _environment(_engine_env(self.config, is_cpu)):
            return AsyncLLM.from_engine_args(args, stat_loggers=[make_stat_logger_factory(self._stats)])

    async def stop(self) -> None:
        """Shut the engine down (its child process and NIXL side channel go with it). Idempotent."""
        llm, self._llm = self._llm, None
        self._transfer_ready = False  # the group went with the engine
        if llm is None:
            return
        # Stop the output handler first: left running, it sees the engine process die and logs it as a failure.
        handler = getattr(llm, "output_handler", None)
        if handler is not None:
            handler.cancel()
        # The engine process ignores SIGTERM while tearing down; vLLM kills it after 5 s.
        await asyncio.to_thread(llm.shutdown)
        self._stats.reset()
        # `AsyncLLM.__del__` shuts down again; if the object lives until interpreter exit (a traceback kept by a
        # test holds it), that second shutdown fails noisily on half-torn-down modules. Once is enough.
        llm.shutdown = lambda timeout=None: None

    async def restart(self, config: VllmEngineConfig | None = None) -> float:
        """Stop, then start with `config` (default: the current one); return the start seconds."""
        await self.stop()
        if config is not None:
            self.config = config
        return await self.start()

    def _engine(self) -> Any:
        if self._llm is None:
            raise BackendError(f"vLLM engine {self.config.engine_id} is not running")
        return self._llm

    # -- requests ------------------------------------------------------------------------------------------------

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        logprobs: bool = True,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        dp_key: str = "",
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        min_tokens: int = 0,
        top_logprobs: int = 0,
    ) -> AsyncIterator[EngineChunk]:
        """Prefill locally and decode up to `max_tokens` tokens, streaming chunks (the last has finished=True).
        `dp_key` (the trajectory): which data-parallel rank serves it (`dp_rank_for`). `min_tokens` counts this
        call's output; `top_logprobs` > 0 streams each token's k most likely alternatives (`EngineChunk`)."""
        params = self._sampling(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            logprobs=logprobs,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            min_tokens=min_tokens,
            top_logprobs=top_logprobs,
        )
        return self._stream(request_id, prompt_token_ids, params, dp_key)

    async def prefill_for_remote_decode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        logprobs: bool = True,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        dp_key: str = "",
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        min_tokens: int = 0,
        top_logprobs: int = 0,
    ) -> PrefillHandoff:
        """Prefill the prompt, sample the first token and keep the KV for a decode engine to pull. `min_tokens` >
        0 keeps that token from being a stop token (it is this call's whole output).

        Raises RequestAborted after `abort(request_id)`, BackendError when the engine fails the request."""
        seed = request_seed(request_id) if seed is None else seed
        params = self._sampling(
            max_tokens=1,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            logprobs=logprobs,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            kv_transfer_params={"do_remote_decode": True},
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            min_tokens=min(min_tokens, 1),
            top_logprobs=top_logprobs,
        )
        last: EngineChunk | None = None
        async for chunk in self._stream(request_id, prompt_token_ids, params, dp_key):
            last = chunk
        if last is None or last.finish_reason == "abort":
            raise RequestAborted(f"prefill {request_id} aborted")
        if last.finish_reason == "error" or not last.token_ids or last.kv_transfer_params is None:
            raise BackendError(f"prefill {request_id} failed: finish_reason={last.finish_reason!r}")
        return PrefillHandoff(
            first_token_id=last.token_ids[0],
            first_logprob=last.logprobs[0] if last.logprobs else None,
            first_top_logprobs=last.top_logprobs[0] if last.top_logprobs else None,
            kv_transfer_params={**last.kv_transfer_params, COMPAT_KEY: self.compat},
            seed=seed,
            num_prompt_tokens=last.num_prompt_tokens,
            num_cached_tokens=last.num_cached_tokens,
            prefill_s=last.ttft_s if last.ttft_s is not None else last.elapsed_s,
            finish_reason=last.finish_reason,
            policy_version=last.token_versions[0] if last.token_versions else None,
        )

    async def decode_from_remote(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        kv_transfer_params: Mapping[str, Any],
        max_tokens: int,
        *,
        seed: int | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        logprobs: bool = True,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        dp_key: str = "",
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        min_tokens: int = 0,
        top_logprobs: int = 0,
    ) -> AsyncIterator[EngineChunk]:
        """Pull the prompt's KV from the prefill engine and decode; output starts with the first token again.

        Pass the `seed` of the PrefillHandoff (default: derived from request_id as the prefill side does), the
        same prompt and sampling. Raises KvUnavailable (before any chunk) when the KV cannot be pulled, or comes
        from an engine this one cannot read KV from (another vLLM, model, dtype, block size or TP: `compat`)."""
        theirs = kv_transfer_params.get(COMPAT_KEY)
        if theirs is not None and theirs != self.compat:
            raise KvUnavailable(
                f"decode {request_id}: KV from {kv_transfer_params.get('remote_engine_id')} is incompatible "
                f"(engine compatibility {theirs} != {self.compat}: another vLLM, model, dtype, block size or TP)"
            )
        kv_transfer_params = {k: v for k, v in kv_transfer_params.items() if k != COMPAT_KEY}
        seed = request_seed(request_id) if seed is None else seed
        params = self._sampling(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            logprobs=logprobs,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            kv_transfer_params=dict(kv_transfer_params),
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            min_tokens=min_tokens,
            top_logprobs=top_logprobs,
        )
        first = True
        async for chunk in self._stream(request_id, prompt_token_ids, params, dp_key):
            if first and chunk.finish_reason == "error" and not chunk.token_ids:
                raise KvUnavailable(
                    f"decode {request_id}: KV pull from {kv_transfer_params.get('remote_engine_id')} failed"
                )
            first = False
            yield chunk

    async def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its stream ends with finish_reason "abort". Unknown ids are ignored, and
        so is everything once the engine is dead (its requests went with it)."""
        if self._llm is not None and not self._dead():
            try:
                await self._llm.abort(request_id)
            except _vllm_errors() as exc:
                raise BackendError(
                    f"abort of {request_id} failed in engine {self.config.engine_id}: {exc!r}"
                ) from exc

    # -- weights and stats ---------------------------------------------------------------------------------------

    async def reload_weights(self, weights_path: str | None = None, version: int | None = None) -> None:
        """Load new weights in place (same architecture) from `weights_path`, or again from the model path, and
        label the tokens sampled from now on `version` (`vllm_weights`). Pauses and resumes the engine itself;
        `load_weights` runs on an engine already paused. Raises BackendError on failure."""
        await self.pause()
        try:
            await self.load_weights(weights_path, version)
        finally:
            await self.resume()

    async def pause(self) -> None:
        """Freeze every request between two steps (`vllm_weights.pause`). Raises BackendError on failure."""
        try:
            await vllm_weights.pause(self._engine())
        except _vllm_errors() as exc:
            raise BackendError(f"engine {self.config.engine_id}: pause failed: {exc!r}") from exc

    async def resume(self) -> None:
        try:
            await vllm_weights.resume(self._engine())
        except _vllm_errors() as exc:
            raise BackendError(f"engine {self.config.engine_id}: resume failed: {exc!r}") from exc

    async def load_weights(self, weights_path: str | None, version: int | None) -> None:
        """On a paused engine: the weights at `weights_path` ("" / None: the model path), labelled `version`."""
        try:
            await vllm_weights.reload_from(self._engine(), weights_path or None, version)
        except _vllm_errors() as exc:
            raise BackendError(
                f"engine {self.config.engine_id}: reloading weights from {weights_path or 'the model path'} "
                f"failed: {exc!r}"
            ) from exc

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's weight-transfer group (`vllm_weights.init_transfer`; the engine must have been started
        with a `weight_transfer_config`, e.g. `{"backend": "nccl"}`). Blocks until the trainer joins too (NCCL's
        rendezvous). Raises BackendError on failure."""
        try:
            await vllm_weights.init_transfer(self._engine(), init_info)
        except (*_vllm_errors(), TypeError, KeyError) as exc:
            raise BackendError(
                f"engine {self.config.engine_id}: joining the weight transfer failed: {exc!r}"
            ) from exc
        self._transfer_ready = True

    async def receive_weights(self, transfer: dict[str, Any], version: int) -> None:
        """On a paused engine: tensors through vLLM's weight-transfer API (`vllm_weights.receive`), `transfer`'s
        `update_info` (the backend's: names/dtype_names/shapes for "nccl"). Raises BackendError when the engine has
        not joined the trainer's group (`init_weight_transfer`) or the transfer fails."""
        if not self._transfer_ready:
            raise BackendError(
                f"engine {self.config.engine_id} has not joined a weight-transfer group (WeightTransferInit first)"
            )
        try:
            await vllm_weights.receive(self._engine(), transfer.get("update_info") or {}, version)
        except (*_vllm_errors(), TypeError, KeyError) as exc:
            raise BackendError(f"engine {self.config.engine_id}: weight transfer failed: {exc!r}") from exc

    async def label_weights(self, version: int) -> None:
        """Label the tokens sampled from now on `version` (at start: the version it serves)."""
        try:
            await vllm_weights.label(self._engine(), version)
        except _vllm_errors() as exc:
            raise BackendError(f"engine {self.config.engine_id}: labelling weights failed: {exc!r}") from exc

    def stats(self) -> VllmEngineStats:
        """Load as of the engine's last step (running/waiting are zero once no request is unfinished)."""
        unfinished = self._llm.get_num_unfinished_requests() if self._llm is not None else 0
        return self._stats.snapshot(
            unfinished, self.kv_capacity_tokens, self.max_batch, self.start_s, self.dp_size
        )

    # -- internals -----------------------------------------------------------------------------------------------

    @staticmethod
    def _sampling(
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None,
        logprobs: bool,
        stop_token_ids: list[int] | None,
        ignore_eos: bool,
        kv_transfer_params: dict[str, Any] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        min_tokens: int = 0,
        top_logprobs: int = 0,
    ) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            # k: the top k and the sampled token's logprob (vLLM adds it when it ranks lower); 0: the sampled only
            logprobs=top_logprobs if top_logprobs > 0 else (0 if logprobs else None),
            stop_token_ids=list(stop_token_ids or []),
            ignore_eos=ignore_eos,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            min_tokens=min(min_tokens, max_tokens),  # vLLM refuses more than max_tokens
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
        )

    async def _stream(
        self, request_id: str, prompt_token_ids: list[int], params: Any, dp_key: str = ""
    ) -> AsyncIterator[EngineChunk]:
        from vllm import TokensPrompt

        llm = self._engine()
        t0 = time.perf_counter()
        state = StreamState(request_id, len(prompt_token_ids), top_logprobs=params.logprobs or 0)
        outputs = llm.generate(
            TokensPrompt(prompt_token_ids=list(prompt_token_ids)),
            params,
            request_id,
            data_parallel_rank=self.dp_rank_for(dp_key),
        )
        try:
            # aclosing: a consumer that stops early closes vLLM's generator, which aborts the request.
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    start = state.num_output_tokens
                    chunk = state.chunk(out, time.perf_counter() - t0)
                    versions = vllm_weights.token_versions(llm, request_id, out, start, len(chunk.token_ids))
                    if versions is not None:
                        chunk = dataclasses.replace(chunk, token_versions=versions)
                    yield chunk
                    if chunk.finished:
                        return
            # vLLM ends a stream aborted from outside without a final output: give the consumer one.
            yield state.final("abort", time.perf_counter() - t0)
        except _vllm_errors() as exc:
            if isinstance(exc, BackendError):
                raise
            if self._dead():
                raise EngineDead(
                    f"request {request_id}: engine {self.config.engine_id} is dead: {exc!r}"
                ) from exc
            raise BackendError(
                f"request {request_id} failed in engine {self.config.engine_id}: {exc!r}"
            ) from exc

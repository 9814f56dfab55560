"""The agent's `Backend` protocol over a real vLLM engine (`vllm_engine.VllmEngine`).

Positions follow `services.engine_agent.backend`: the context is `prompt_token_ids + resume_token_ids`, the output
is the whole turn (`sampling.max_tokens` tokens, the first `len(resume)` already streamed elsewhere).

Prefill/decode across engines. The NIXL connector's decode engine recomputes the last prompt token and samples the
first output token itself; the protocol says the decode stream starts *after* the prefill engine's first token
(the agent has streamed that one already). Both engines therefore sample with the same seed (the request's, else
one derived from request id and resume length), which makes the decode engine draw the same first token from the
same logits; the backend drops it from the decode stream. Should it still differ (numerics at a tie), the
continuation would follow a token the client never saw, so the backend abandons the pulled KV and prefills
context + first token locally instead: slower, never wrong.

Data parallelism. An engine with `data_parallel_size` > 1 is one `AsyncLLM` over several ranks: every turn of a
trajectory goes to the rank its id hashes to (`VllmEngine.dp_rank_for`), which holds its prefix; load, KV and
batch count every rank.

Capacity. `stats()` reports vLLM's own KV use (`kv_measured`: every rank, blocks pinned for handoffs no decode
engine has claimed yet included, as vLLM keeps them allocated) and its preemptions, which decode admission reads
(`measured_capacity.py`). vLLM does not report how many freed blocks it keeps for reuse, so
`prefix_cache_tokens` is counted here: the contexts of the trajectories this engine served last (the newest
first, each trajectory once), as many tokens as its KV cache holds — the LRU order in which vLLM evicts them.

Sampling. A turn's `SamplingParams` map onto vLLM's: temperature, top-p/top-k, seed, stop token ids, ignore_eos,
the presence, frequency and repetition penalties, `min_tokens` and `top_logprobs` (vLLM's `logprobs=k`). Counts
that vLLM keeps per request start at this engine's first output token: `min_tokens` is reduced by the tokens a
migrated request already streamed, and its presence/frequency penalties do not count those (vLLM sees them as
prompt; the repetition penalty, which counts the prompt too, does). A decode after a handoff samples the first
token again, so its counts are whole. Which logprobs come back is vLLM's engine-wide `logprobs_mode` (an engine
argument; raw_logprobs by default): a turn asking for the other kind is refused by `sampling_problem`, as is one
asking for more alternatives than `max_logprobs`.

Weights. A load pauses the engine (vLLM's "keep" mode: requests freeze between two steps), replaces the weights
from a checkpoint or through vLLM's weight-transfer API, labels the steps after it with the new policy version and
resumes (`vllm_weights`); each stream's chunks are cut where vLLM's labels change, so none spans two versions. A
trainer's pause holds the same vLLM pause; the engine runs again once neither holds it.

Roles. Every engine runs the NIXL connector as `kv_both`, so prefill, decode and mixed work need no restart:
`set_role` only restarts the engine when `role_overrides` gives the new role different engine settings (for
example a larger batch for decode), and that restart costs a full engine start (tens of seconds on CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec

from proto import DecodeHandoff, GenerateRequest, SamplingParams
from services.engine_agent.backend import (
    BackendError,
    BackendStats,
    GenChunk,
    KvUnavailable,
    PrefillInfo,
    PrefillResult,
    RequestAborted,
)
from services.engine_agent.backends.vllm_engine import EngineChunk, VllmEngine, VllmEngineConfig, request_seed
from services.runtime.clock import Clock

log = logging.getLogger(__name__)

# Start a remote decode only while the prefill engine surely still holds the KV (its lease runs from the prefill,
# `handed_off_s`); past this fraction of the lease the blocks may be freed and reused before the pull.
_LEASE_SAFETY = 0.8


def _context(request: GenerateRequest) -> list[int]:
    if not request.prompt_token_ids:
        raise BackendError(f"request {request.request_id}: the vLLM backend needs prompt_token_ids")
    return list(request.prompt_token_ids) + list(request.resume_token_ids)


def _seed(request: GenerateRequest) -> int:
    if request.sampling.seed is not None:
        return request.sampling.seed
    return request_seed(f"{request.request_id}:{len(request.resume_token_ids)}")


def _finish_reason(chunk: EngineChunk) -> str:
    """vLLM's finish reason in the protocol's terms. Raises BackendError for an engine-side failure."""
    if not chunk.finished:
        return ""
    if chunk.finish_reason == "error":
        raise BackendError(f"request {chunk.request_id} failed inside the engine")
    return chunk.finish_reason if chunk.finish_reason in ("length", "abort") else "stop"


class VllmBackend:
    """`Backend` over one vLLM engine (see the module docstring)."""

    name = "vllm"

    def __init__(
        self,
        config: VllmEngineConfig,
        *,
        role: str = "mixed",
        role_overrides: Mapping[str, Mapping[str, Any]] | None = None,
        clock: Clock | None = None,
    ) -> None:
        """`clock`: the scaled clock handoffs are stamped on (None: $PRORSA_TIME_SCALE's, read now)."""
        self.clock = clock if clock is not None else Clock.from_env()
        self.engine = VllmEngine(config)
        self.role = role
        self.role_overrides = dict(role_overrides or {})
        self.policy_version = 0  # the weights version serving now (vLLM labels its steps with it)
        self._pause_reasons: set[str] = set()
        self._contexts: OrderedDict[str, int] = OrderedDict()  # traj_id -> context tokens, newest last

    @property
    def max_model_len(self) -> int:
        """vLLM's resolved model length once started (an engine argument may have set it)."""
        return self.engine.max_model_len

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.engine.start()
        await self.engine.label_weights(self.policy_version)

    async def close(self) -> None:
        await self.engine.stop()

    async def check_alive(self) -> None:
        await self.engine.check_alive()

    def _served(self, request: GenerateRequest, tokens: int) -> None:
        """This engine now holds `tokens` of the trajectory's context (see "Capacity" in the module doc)."""
        key = request.traj_id or request.request_id
        self._contexts.pop(key, None)
        self._contexts[key] = tokens
        capacity = self.engine.kv_capacity_tokens
        while len(self._contexts) > 1 and sum(self._contexts.values()) > capacity > 0:
            self._contexts.popitem(last=False)

    def prefix_cache_tokens(self) -> int:
        return min(sum(self._contexts.values()), self.engine.kv_capacity_tokens)

    # -- work ----------------------------------------------------------------------------------------------------

    def _remaining(self, request: GenerateRequest) -> int:
        """Output tokens still to generate: max_tokens for the whole turn, capped by the model length."""
        context = len(request.prompt_token_ids) + len(request.resume_token_ids)
        end = min(
            request.sampling.max_tokens, len(request.resume_token_ids) + max(0, self.max_model_len - context)
        )
        return end - len(request.resume_token_ids)

    def _sampling(self, request: GenerateRequest) -> dict[str, Any]:
        """The engine's sampling keywords for one call, whose output starts at position len(resume)."""
        s = request.sampling
        return {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "logprobs": s.logprobs,
            "stop_token_ids": list(s.stop_token_ids),
            "ignore_eos": s.ignore_eos,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "repetition_penalty": s.repetition_penalty,
            "min_tokens": max(0, s.min_tokens - len(request.resume_token_ids)),
            "top_logprobs": s.top_logprobs,
        }

    def sampling_problem(self, sampling: SamplingParams) -> str:
        """See "Sampling" in the module doc."""
        mode = self.engine.logprobs_mode
        if sampling.logprobs_mode and sampling.logprobs_mode != mode:
            return (
                f"logprobs_mode {sampling.logprobs_mode!r} asked for, but engine {self.engine.config.engine_id} "
                f"returns {mode!r} (vLLM's engine argument logprobs_mode)"
            )
        cap = self.engine.max_logprobs
        if 0 <= cap < sampling.top_logprobs:
            return f"top_logprobs {sampling.top_logprobs} exceeds the engine's max_logprobs {cap}"
        return ""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenChunk]:
        context = _context(request)
        remaining = self._remaining(request)
        if remaining <= 0:
            yield GenChunk([], None, finished=True, finish_reason="length", prefill=PrefillInfo(0, 0, 0.0))
            return
        stream = self.engine.generate(
            request.request_id,
            context,
            remaining,
            seed=request.sampling.seed,
            dp_key=request.traj_id,
            **self._sampling(request),
        )
        first = True
        produced = 0
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                produced += len(chunk.token_ids)
                if chunk.finished:
                    self._served(request, len(context) + produced)
                prefill = None
                if first:
                    cached = chunk.num_cached_tokens
                    prefill = PrefillInfo(len(context) - cached, cached, chunk.ttft_s or chunk.elapsed_s)
                    first = False
                for i, part in enumerate(self._by_version(chunk)):
                    yield dataclasses.replace(part, prefill=prefill if i == 0 else None)

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        context = _context(request)
        remaining = self._remaining(request)
        if remaining <= 0:
            raise BackendError(f"request {request.request_id}: nothing left to generate")
        if remaining == 1:
            # The first token is the last: no decode follows, so keep no KV for one.
            return await self._prefill_only(request, context)
        h = await self.engine.prefill_for_remote_decode(
            request.request_id,
            context,
            seed=_seed(request),
            dp_key=request.traj_id,
            **self._sampling(request),
        )
        self._served(request, len(context))
        finished = h.finish_reason != "length"  # a stop token: the turn ends here
        return PrefillResult(
            first_token_id=h.first_token_id,
            first_logprob=h.first_logprob,
            first_top_logprobs=h.first_top_logprobs,
            kv_transfer_params=h.kv_transfer_params,
            new_tokens=h.num_prompt_tokens - h.num_cached_tokens,
            cached_tokens=h.num_cached_tokens,
            prefill_s=h.prefill_s,
            finished=finished,
            finish_reason="stop" if finished else "",
            policy_version=h.policy_version,
        )

    async def _prefill_only(self, request: GenerateRequest, context: list[int]) -> PrefillResult:
        chunks = [
            c async for c in self.engine.generate(request.request_id, context, 1, **self._sampling(request))
        ]
        last = chunks[-1]
        reason = _finish_reason(last)
        tokens = [t for c in chunks for t in c.token_ids]
        logprobs = [lp for c in chunks for lp in (c.logprobs or [])]
        tops = [t for c in chunks for t in (c.top_logprobs or [])]
        versions = [v for c in chunks for v in (c.token_versions or [])]
        if reason == "abort" or not tokens:
            raise RequestAborted(f"prefill {request.request_id} aborted")
        return PrefillResult(
            first_token_id=tokens[0],
            first_logprob=logprobs[0] if logprobs else None,
            first_top_logprobs=tops[0] if tops else None,
            kv_transfer_params=None,
            new_tokens=len(context) - last.num_cached_tokens,
            cached_tokens=last.num_cached_tokens,
            prefill_s=last.ttft_s or last.elapsed_s,
            finished=True,
            finish_reason=reason,
            policy_version=versions[0] if versions else None,
        )

    async def decode(self, handoff: DecodeHandoff) -> AsyncIterator[GenChunk]:
        request = handoff.request
        context = _context(request)
        remaining = self._remaining(request)  # includes the handed-off first token
        if remaining <= 1:
            yield GenChunk([], None, finished=True, finish_reason="length")
            return
        if handoff.first_token_id is None:
            raise BackendError(f"handoff {request.request_id} has no first token")
        if self._is_own_handoff(handoff):
            # This engine prefilled the request itself (it switched from prefill to decode and then pulled its own
            # handoff). NIXL cannot read from its own engine (the handshake fails: "Cannot register local engine
            # as remote"), but the prompt's blocks are still here, pinned by the lease and in the prefix cache: a
            # local prefill of context + first token hits them and recomputes at most the last partial block.
            # The pinned blocks are not released early (that notification also goes through NIXL); the lease
            # frees them.
            async for chunk in self._decode_locally(request, handoff.first_token_id):
                yield chunk
            return
        self._check_lease(handoff)
        stream = self.engine.decode_from_remote(
            request.request_id,
            context,
            handoff.kv_transfer_params or {},
            remaining,
            seed=_seed(request),
            dp_key=request.traj_id,
            **self._sampling(request),
        )
        produced = 0
        async with contextlib.aclosing(stream):
            first = await anext(stream)  # raises KvUnavailable when the pull fails
            if first.token_ids and first.token_ids[0] != handoff.first_token_id:
                log.warning(
                    "decode %s: first token %d differs from the prefill's %d; recomputing locally",
                    request.request_id,
                    first.token_ids[0],
                    handoff.first_token_id,
                )
                await stream.aclose()
                async for chunk in self._decode_locally(request, handoff.first_token_id):
                    yield chunk
                return
            for part in self._by_version(first, skip=1):
                yield part
            async for chunk in stream:
                produced += len(chunk.token_ids)
                if chunk.finished:
                    self._served(request, len(context) + 1 + produced)
                for part in self._by_version(chunk):
                    yield part

    def _is_own_handoff(self, handoff: DecodeHandoff) -> bool:
        params = handoff.kv_transfer_params or {}
        return params.get("remote_engine_id") == self.engine.config.engine_id

    def _check_lease(self, handoff: DecodeHandoff) -> None:
        if handoff.kv_transfer_params is None:
            raise KvUnavailable(f"handoff {handoff.request.request_id} names no KV")
        lease_s = self.engine.config.kv_lease_s
        # `handed_off_s` is a stamp of the shared scaled clock; the lease is vLLM's, in wall seconds.
        age_wall_s = self.clock.wall_s(self.clock.now_s() - handoff.handed_off_s)
        if handoff.handed_off_s > 0 and age_wall_s > _LEASE_SAFETY * lease_s:
            raise KvUnavailable(
                f"handoff {handoff.request.request_id} is older than {_LEASE_SAFETY:.0%} of the {lease_s} s KV lease"
            )

    def _by_version(self, chunk: EngineChunk, skip: int = 0) -> list[GenChunk]:
        """`chunk` (less its first `skip` tokens) as GenChunks, cut where the weights version changes; only the
        last may be final. Tokens vLLM did not label are stamped with the version serving now."""
        ids = chunk.token_ids[skip:]
        lps = chunk.logprobs[skip:] if chunk.logprobs is not None else None
        tops = chunk.top_logprobs[skip:] if chunk.top_logprobs is not None else None
        versions = (chunk.token_versions or [])[skip:]
        if len(versions) != len(ids):
            versions = [self.policy_version] * len(ids)
        runs: list[tuple[int, int, int]] = []  # (start, end, version)
        for i, v in enumerate(versions):
            if runs and runs[-1][2] == v:
                runs[-1] = (runs[-1][0], i + 1, v)
            else:
                runs.append((i, i + 1, v))
        if not runs:
            runs = [(0, 0, self.policy_version)]
        reason = _finish_reason(chunk)
        return [
            GenChunk(
                ids[a:b],
                lps[a:b] if lps is not None else None,
                finished=chunk.finished and k == len(runs) - 1,
                finish_reason=reason if k == len(runs) - 1 else "",
                top_logprobs=tops[a:b] if tops is not None else None,
                policy_version=v,
            )
            for k, (a, b, v) in enumerate(runs)
        ]

    async def _decode_locally(self, request: GenerateRequest, first_token_id: int) -> AsyncIterator[GenChunk]:
        resumed = msgspec.structs.replace(
            request, resume_token_ids=[*request.resume_token_ids, first_token_id]
        )
        async for chunk in self.generate(resumed):
            yield dataclasses.replace(chunk, prefill=None)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def wait_output(self, request_id: str, max_wait_s: float) -> None:
        # A plain pause: at speed 1 the last chunk's extra wait is at most one interval of wall time.
        await asyncio.sleep(max_wait_s)

    # -- load, weights, role -------------------------------------------------------------------------------------

    def stats(self) -> BackendStats:
        s = self.engine.stats()
        return BackendStats(
            running=s.running,
            waiting=s.waiting,
            kv_used_tokens=round(s.kv_usage * s.kv_capacity_tokens),
            kv_capacity_tokens=s.kv_capacity_tokens,
            max_batch=s.max_batch,
            prefix_cache_tokens=self.prefix_cache_tokens(),
            kv_measured=True,
            preemptions=s.preemptions,
            restart_roles=self.restart_roles(),
        )

    def restart_roles(self) -> tuple[str, ...]:
        """Roles whose engine settings (`role_overrides`) differ from the running engine's: switching to them
        restarts it."""
        current = self.engine.config
        return tuple(
            role
            for role, overrides in sorted(self.role_overrides.items())
            if overrides and dataclasses.replace(current, **overrides) != current
        )

    def expected_output_tokens(self, request: GenerateRequest) -> int:
        # A real model's output length is unknown before it stops: the upper bound.
        return min(request.sampling.max_tokens, max(0, self.max_model_len - request.prompt_len))

    async def reload_weights(self, version: int, weights_path: str) -> None:
        await self.pause_generation("weights")
        try:
            await self.engine.load_weights(weights_path or None, version)
            self.policy_version = version
        finally:
            await self.resume_generation("weights")
        self._contexts.clear()  # the prefix cache was dropped with the old weights

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        await self.engine.init_weight_transfer(init_info)

    async def receive_weights(self, version: int, transfer: dict[str, Any]) -> None:
        await self.pause_generation("weights")
        try:
            await self.engine.receive_weights(transfer, version)
            self.policy_version = version
        finally:
            await self.resume_generation("weights")
        self._contexts.clear()

    async def pause_generation(self, reason: str) -> None:
        if not self._pause_reasons:
            await self.engine.pause()
        self._pause_reasons.add(reason)

    async def resume_generation(self, reason: str) -> None:
        if reason not in self._pause_reasons:
            return
        self._pause_reasons.discard(reason)
        if not self._pause_reasons:
            await self.engine.resume()

    async def set_role(self, role: str) -> None:
        overrides = self.role_overrides.get(role)
        if overrides:
            new_config = dataclasses.replace(self.engine.config, **overrides)
            if new_config != self.engine.config:
                await self.engine.restart(new_config)
                self._contexts.clear()  # a restarted engine's prefix cache is empty
        self.role = role

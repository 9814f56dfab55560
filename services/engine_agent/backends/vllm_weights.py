"""New weights for a running vLLM engine, and the weights version of every token it samples (vLLM 0.32).

Theory of operation (read from vLLM 0.32's sources):
- `AsyncLLM.pause_generation(mode="keep")` freezes every request between two engine steps and admits none until
  `resume_generation()`; the requests then go on where they stopped. Weights are replaced meanwhile, either from a
  checkpoint directory (`collective_rpc("reload_weights", weights_path=...)`: the workers reload in place, same
  architecture) or as tensors through the weight-transfer API (`init_weight_transfer_engine` once, then per update
  `start_weight_update`, `update_weights(WeightTransferUpdateRequest(update_info))`, `finish_weight_update`; the
  backend — "nccl", "ipc", ... — is the engine argument `weight_transfer_config`, and the trainer sends the tensors
  from its side concurrently, e.g. vLLM's `NCCLTrainerWeightTransferEngine`).
- Labels. The engine core stamps every step's outputs with its weight version (`set_weight_version`, a string;
  `EngineCoreOutputs.weight_version`), and the output processor keeps, per request, where each version's tokens
  start (`RequestState.weight_version_starts`; on the final output `CompletionOutput.weight_versions` spans). We label
  with the policy version (its decimal string) while paused, so every token after the resume carries the new one:
  the version of each streamed token is read from those spans (`token_versions`).
- The prefix cache is dropped while paused, so no later request reuses KV computed with the old weights; running
  requests are preempted by that reset and recompute their context under the new weights when they resume (vLLM's
  `reset_prefix_cache(reset_running_requests=True)`), so no token after the update is sampled on old KV. Blocks
  pinned for a decode engine's pull (a prefill handed off, not yet claimed) make the reset impossible: it is then
  skipped with a warning (the handoff rule recomputes such a turn on a decode engine of another version anyway).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

SETTLE_S = (
    0.02  # after pausing: outputs of the last step are still being processed (as vLLM's own pause waits)
)


def parse_label(label: Any) -> int | None:
    """A policy version from vLLM's weight-version label ("12"); None for a label that is not ours ("default")."""
    if isinstance(label, str) and label.isdigit():
        return int(label)
    return None


async def label(llm: Any, version: int) -> None:
    """Label the steps from now on with `version`."""
    await llm.update_weight_version(str(version))


async def pause(llm: Any) -> None:
    await llm.pause_generation(mode="keep", clear_cache=False)
    await asyncio.sleep(SETTLE_S)


async def resume(llm: Any) -> None:
    await llm.resume_generation()


async def reload_from(llm: Any, weights_path: str | None, version: int | None) -> None:
    """While paused: load weights from `weights_path` (None: the model path again), label, drop stale KV."""
    kwargs = {"weights_path": weights_path} if weights_path else {}
    await llm.collective_rpc("reload_weights", kwargs=kwargs)
    if version is not None:
        await label(llm, version)
    await drop_stale_kv(llm)


async def init_transfer(llm: Any, init_info: dict[str, Any]) -> None:
    """Join the trainer's weight-transfer group (once per engine; NCCL: a rendezvous the trainer joins too)."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=dict(init_info)))


async def receive(llm: Any, update_info: Any, version: int) -> None:
    """While paused: receive the tensors the trainer sends now (`update_info`: names, dtypes, shapes for "nccl"),
    label them `version`, drop stale KV."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    await llm.start_weight_update()
    await llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
    await llm.finish_weight_update(weight_version=str(version))
    await drop_stale_kv(llm)


async def drop_stale_kv(llm: Any) -> bool:
    """Drop the prefix cache and recompute running requests' KV (see the module doc); False when vLLM could not."""
    if await llm.reset_prefix_cache():
        return True  # nothing was running (a drained engine)
    try:
        ok = bool(await llm.reset_prefix_cache(reset_running_requests=True))
    except Exception as exc:
        # vLLM turns a utility call that failed in the engine core into a bare Exception carrying the core's message
        # ("Failed to reset KV cache ...": blocks pinned for a remote decode's pull). Only that one is expected.
        if "reset KV cache" not in str(exc):
            raise
        ok = False
    if not ok:
        log.warning("prefix cache kept after a weight update: blocks pinned for a handoff")
    return ok


def token_versions(llm: Any, request_id: str, out: Any, start: int, count: int) -> list[int] | None:
    """The policy version of output tokens [start, start + count) of `request_id`, from vLLM's labels (see the
    module doc); None where vLLM has no label of ours for them."""
    completion = out.outputs[0]
    spans: list[tuple[Any, int]]
    if completion.weight_versions is not None:  # the final output carries the whole request's spans
        spans = [(s.version, int(s.start)) for s in completion.weight_versions]
    else:
        processor = llm.output_processor
        internal = processor.external_req_ids.get(request_id) or []
        state = processor.request_states.get(internal[-1]) if internal else None
        if state is None:
            return None
        spans = [(v, int(s)) for v, s in state.weight_version_starts]
    if not spans:
        return None
    out_versions: list[int] = []
    for i in range(start, start + count):
        found = None
        for version_label, at in spans:
            if at <= i:
                found = parse_label(version_label)
        if found is None:
            return None
        out_versions.append(found)
    return out_versions

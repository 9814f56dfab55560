"""Tensors from the trainer to every engine through vLLM's weight-transfer API, with Prorsa's barrier.

vLLM 0.32's trainer side (`vllm.distributed.weight_transfer`: `NCCLTrainerWeightTransferEngine`, ...) drives an
inference engine through a small synchronous protocol, `VLLMWeightSyncClient`: `init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`. `BusWeightSyncClient` implements it over the bus,
for every engine of the cluster at once:

    sync = BusWeightSyncClient(client, loop, rank_offsets={"engine-0": 1, "engine-1": 2}, first_version=1)
    trainer = NCCLTrainerWeightTransferEngine.trainer_init(
        NCCLTrainerInitInfo(rank=0, master_address=ip, master_port=port, world_size=3),
        client=sync, source=ModuleSource(model),
    )
    ...  # a training step
    trainer.send_weights()   # every engine receives the tensors and serves version 1 when this returns

- `init_weight_transfer_engine(init_info)` puts a `WeightTransferInit` (key `transfer` of the policy bucket) and
  waits until every live engine joined (each with its `rank_offsets` entry), while vLLM's trainer engine opens its
  end of the group on its own thread, as it does with one engine.
- `update_weights(update_info)` is one `RolloutClient.update_weights(version, transfer={"update_info": ...})`: it
  returns once every live engine received the tensors (broadcast meanwhile by the trainer engine) and serves the
  version; versions count up from `first_version`.
- `start_weight_update` and `finish_weight_update` have nothing to do: each engine pauses, receives, labels and
  resumes within its update (`services/engine_agent/backends/vllm_weights.py`).

The methods block (the protocol is synchronous and vLLM calls `update_weights` from a worker thread), so they run
the client's coroutines on the client's event loop (`loop`, running in another thread) and wait for them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prorsa.client.client import RolloutClient


class BusWeightSyncClient:
    """vLLM's `VLLMWeightSyncClient` over a Prorsa cluster (see the module doc)."""

    def __init__(
        self,
        client: RolloutClient,
        loop: asyncio.AbstractEventLoop,
        *,
        rank_offsets: dict[str, int] | None = None,
        first_version: int = 1,
        mode: str = "drain",
        timeout_s: float = 600.0,
    ) -> None:
        self.client = client
        self.loop = loop
        self.rank_offsets = dict(rank_offsets or {})
        self.version = first_version  # the version the next update_weights makes current
        self.mode = mode
        self.timeout_s = timeout_s

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s + 30.0)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._run(self.client.init_weight_transfer(init_info, self.rank_offsets, timeout_s=self.timeout_s))

    def start_weight_update(self) -> None:
        """Nothing to do: each engine pauses within its own update."""

    def update_weights(self, update_info: Any) -> None:
        update = {"update_info": update_info}
        self._run(
            self.client.update_weights(
                self.version, transfer=update, timeout_s=self.timeout_s, mode=self.mode
            )
        )
        self.version += 1

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Nothing to do: each engine labels the new weights and resumes within its own update."""

"""`rollout.name=prorsa`: verl's rollout replica for a Prorsa cluster. Importing this module registers it.

verl models a rollout backend as replicas (`RolloutReplica`: one inference server each) that it launches on its own
resources, puts to sleep while the actor trains, wakes, and pushes weights to. A Prorsa cluster is none of that: its
engines run apart from the trainer (`prorsa up`, or a deployment), roles and placement are Prorsa's, and the cluster
keeps the current policy version itself. So this replica launches nothing and holds no GPU; it stands for the
cluster:

- `init_*` / `launch_servers`: connect once, to fail early on a wrong URL or credentials; `server_address` is the
  NATS URL. No Ray workers, no resource pool.
- `update_weights(global_steps, weights=... | checkpoint_dir=...)`: writes the trained tensors as a model directory
  under the weights root the engines accept (`prorsa.trainers.checkpoint`), then calls the barrier,
  `RolloutClient.update_weights(version, source)`, which returns once every live engine serves the version (and
  raises `WeightUpdateError` naming the engines that do not). verl numbers versions by `global_steps`.
- `sleep`, `wake_up`, `clear_kv_cache`, `release_kv_cache`, `resume_kv_cache`, profiling: nothing to do (the
  engines are not on the trainer's devices).
- `abort_all_requests` / `resume_generation`: pause and resume generation on the cluster.

Only replica 0 acts: verl may build several replicas from its GPU arithmetic (`n_gpus_per_node * nnodes / tp`),
and one cluster must not be told the same thing once per replica.

verl finds a replica class by name in `RolloutReplicaRegistry`, in the process that builds the replicas: import this
module in the trainer's entry point, or name it in `actor_rollout_ref.model.external_lib` (verl imports that).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry

from prorsa.trainers.checkpoint import save_checkpoint
from prorsa.trainers.settings import prorsa_settings

NAME = "prorsa"


class ProrsaReplica(RolloutReplica):
    """A Prorsa cluster as verl's rollout replica (see the module doc). Raises ValueError on bad `custom.prorsa`
    settings, NoClusterError when no NATS URL is set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = prorsa_settings(self.config)
        self.connection = self.settings.connection()

    @property
    def speaks_for_cluster(self) -> bool:
        return self.replica_rank == 0

    # -- launch: nothing to launch -----------------------------------------------------------------------------
    async def init_hybrid(self, worker_group: Any) -> None:
        self.rollout_mode = RolloutMode.HYBRID
        await self.launch_servers()

    async def init_hybrid_colocated(self, worker_group: Any, resource_pool: Any) -> None:
        self.rollout_mode = RolloutMode.HYBRID
        await self.launch_servers()

    async def init_colocated(self, resource_pool: Any) -> None:
        self.rollout_mode = RolloutMode.COLOCATED
        await self.launch_servers()

    async def init_standalone(self) -> None:
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    async def launch_servers(self) -> None:
        """Connect once (raises CredentialsError for refused credentials, or waits for a server not up yet)."""
        async with self.connection.session():
            pass
        self._server_address = self.connection.url
        self._server_handle = None
        self.servers = []

    # -- weights -------------------------------------------------------------------------------------------------
    async def update_weights(
        self,
        global_steps: int,
        weights: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
        checkpoint_dir: str | None = None,
    ) -> Any:
        """Serve policy version `global_steps` on every engine: from `weights` (a state dict or verl's (name,
        tensor) generator, written to `<weights_root>/global_step_<N>`) or from an already written
        `checkpoint_dir` under the weights root. Returns the barrier's `WeightsAck` (None on replicas other than
        0). Raises ValueError unless exactly one of `weights` and `checkpoint_dir` is given, WeightUpdateError
        when engines do not serve the version within `update_timeout_s`."""
        if (weights is None) == (checkpoint_dir is None):
            raise ValueError("update_weights takes exactly one of weights= and checkpoint_dir=")
        if not self.speaks_for_cluster:
            return None
        if weights is not None:
            out = Path(self.settings.weights_dir()) / f"global_step_{int(global_steps)}"
            checkpoint_dir = str(save_checkpoint(weights, out, self._base_model_dir()))
        async with self.connection.session() as client:
            return await client.update_weights(
                int(global_steps), str(checkpoint_dir), timeout_s=self.settings.update_timeout_s
            )

    def _base_model_dir(self) -> str:
        mc = self.model_config  # verl hands the replica its DictConfig, or an HFModelConfig
        return str(getattr(mc, "local_path", None) or mc.path)

    # -- generation control --------------------------------------------------------------------------------------
    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Pause generation on the cluster (verl calls this before it syncs weights, and for partial rollout)."""
        if self.speaks_for_cluster:
            async with self.connection.session() as client:
                await client.pause()

    async def resume_generation(self) -> None:
        if self.speaks_for_cluster:
            async with self.connection.session() as client:
                await client.resume()

    # -- memory and profiling: the engines are not on the trainer's devices ----------------------------------
    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


RolloutReplicaRegistry.register(NAME, lambda: ProrsaReplica)

"""AReaL (1.0) on Prorsa: `ProrsaInferenceEngine`, an `areal.api.engine_api.InferenceEngine` that AReaL's own
`WorkflowExecutor` drives, in place of its `RemoteSGLangEngine` / `RemotevLLMEngine`.

    engine = ProrsaInferenceEngine(InferenceEngineConfig(experiment_name=..., trial_name=...), Connection.from_env())
    engine.initialize()                        # builds and starts AReaL's WorkflowExecutor over this engine
    batch = engine.rollout_batch(data, workflow=RLVRWorkflow(...))   # or submit/wait, prepare_batch
    engine.pause(); engine.pause_generation()
    engine.update_weights_from_disk(meta.with_version(v)).result()   # the barrier: every engine serves v
    engine.continue_generation(); engine.set_version(v); engine.resume()

What AReaL calls, and what it does here:
- `agenerate(req)`: one model turn. AReaL's executor runs workflows in a background thread with its own (uv)loop,
  so the engine holds a `Connection` and each loop connects once. Every `ModelResponse` carries the version that
  produced each token (`output_versions`), as the engines stamped them, so a turn that straddles an in-flight
  update holds two versions (AReaL's own remote engines stamp the trainer-side counter instead). A turn cut off by
  a pause or an abort of its version goes on from where it stopped, as AReaL's engines do (interruptible rollout),
  and a request names the oldest version it accepts: `get_version() - max_head_offpolicyness`.
- Episodes and trajectories. `submit`, `rollout_batch` and `prepare_batch` wrap the workflow so that each episode
  (one `arun_episode`) is a Prorsa episode: its turns are filed into trajectories, and every trajectory is finished
  when the episode ends (with the episode's reward when it opened one trajectory; aborted when the workflow rejects
  the episode or raises). Each sample of a group (`group_size`) is an episode of its own. AReaL's workflows draw a fresh `rid` for every turn, so a turn joins the trajectory whose
  last context (prompt + output) its prompt extends, else the one with its `rid`, else starts one: the multi-turn
  workflow's retries form one trajectory, a group's samples one each. A turn requested outside such an episode is a
  trajectory of its own, finished at once.
- `update_weights_from_disk(meta)`: returns a Future. Like AReaL's remote engines it first waits for the trainer's
  "checkpoint saved" record (AReaL's name_resolve key `update_weights_from_disk/<version>`, when the config names an
  experiment and a trial; without them the checkpoint must be on disk when it is called), then calls the barrier,
  `RolloutClient.update_weights(meta.version, meta.path, mode=...)`, which returns once every live engine serves the
  version. The checkpoint directory must lie under the engines' weights root. `clear_checkpoint_after_load` removes
  the previous version's directory, never the current one: an engine that restarts loads the current version from it.
- `pause_generation` / `continue_generation`: pause and resume generation on the whole cluster (the engines freeze
  their running turns; nothing is lost). `pause` / `resume`: the executor's submission gate, as in AReaL.
- `set_version` / `get_version`: the trainer's counter (the staleness manager reads it).
- `offload` / `onload`: nothing (the engines are not on the trainer's devices); `export_stats`: what the workflows
  recorded, as AReaL's remote engines export it. `launch_server`,
  `init_weights_update_group`, `update_weights_from_distributed`, `compute_logp`: not offered (NotImplementedError
  saying why).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from areal.api import InferenceEngine, RolloutWorkflow
from areal.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta
from areal.infra.workflow_executor import WorkflowExecutor

from prorsa.client.client import RolloutClient, Trajectory
from prorsa.client.surely import surely
from prorsa.trainers.connection import Connection
from prorsa.trainers.verl import refuse_multimodal
from proto import SamplingParams

# AReaL's ModelResponse.stop_reason: "length" | "stop" | "tool_calls" | "abort".
AREAL_STOP_REASON = {"stop": "stop", "length": "length", "abort": "abort", "error": "abort"}
MODES = ("inflight", "drain")
# How often a turn looks whether the executor's gate reopened (AReaL's own engines: 0.5 s).
PAUSED_POLL_S = 0.5


def sampling_from_gconfig(gconfig: Any, max_new_tokens: int) -> SamplingParams:
    """AReaL `GenerationHyperparameters` → SamplingParams for `max_new_tokens`. Raises ValueError for n_samples != 1
    (AReaL's workflows send one request per sample) and for what Prorsa engines cannot honour (stop strings, beam
    search)."""
    if gconfig.n_samples != 1:
        raise ValueError(f"one request per sample: n_samples must be 1, got {gconfig.n_samples}")
    if getattr(gconfig, "use_beam_search", False):
        raise ValueError("gconfig.use_beam_search: Prorsa engines sample; they do not search beams")
    if getattr(gconfig, "stop", None):
        raise ValueError(
            f"gconfig.stop = {gconfig.stop!r}: Prorsa engines stop on token ids (stop_token_ids)"
        )
    return SamplingParams(
        max_tokens=int(max_new_tokens),
        temperature=0.0 if gconfig.greedy else float(gconfig.temperature),
        top_p=float(gconfig.top_p),
        top_k=int(gconfig.top_k),
        stop_token_ids=[int(t) for t in gconfig.stop_token_ids if t is not None],
        ignore_eos=bool(gconfig.ignore_eos),
        frequency_penalty=float(getattr(gconfig, "frequency_penalty", 0.0)),
        min_tokens=min(int(getattr(gconfig, "min_new_tokens", 0)), int(max_new_tokens)),
    )


@dataclass
class _Line:
    """One Prorsa trajectory of an episode: what its next turn must extend, and whether a turn is running."""

    traj: Trajectory
    context: list[int] = field(default_factory=list)  # its last prompt + output
    rids: set[str] = field(default_factory=set)
    busy: bool = False


@dataclass
class ArealEpisode:
    """The trajectories of one `arun_episode` (see the module doc for how turns are filed)."""

    lines: list[_Line] = field(default_factory=list)

    def place(self, rid: str, input_ids: list[int]) -> _Line | None:
        idle = [line for line in self.lines if not line.busy]
        extends = [ln for ln in idle if ln.context and input_ids[: len(ln.context)] == ln.context]
        if extends:
            return max(extends, key=lambda ln: len(ln.context))
        return next((ln for ln in idle if rid in ln.rids), None)

    async def finish(self, reward: float | None = None, status: str = "finished") -> None:
        for line in self.lines:
            await line.traj.finish(reward=reward, status=status)


CURRENT_EPISODE: ContextVar[ArealEpisode | None] = ContextVar("prorsa_areal_episode", default=None)


class ProrsaEpisodes(RolloutWorkflow):
    """An AReaL workflow run as Prorsa episodes: every trajectory an episode opens is finished when it ends."""

    def __init__(self, workflow: RolloutWorkflow) -> None:
        self.workflow = workflow

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        episode = ArealEpisode()
        token = CURRENT_EPISODE.set(episode)
        try:
            result = await self.workflow.arun_episode(engine, data)
        except BaseException:
            # Waited for through every cancellation (prorsa.client.surely): a cancelled episode still reports its
            # trajectories, so none waits for the tracker's timeout.
            await surely(episode.finish(status="aborted"))
            raise
        finally:
            CURRENT_EPISODE.reset(token)
        if result is None:  # the workflow rejected the episode
            await episode.finish(status="aborted")
            return None
        await episode.finish(reward=_episode_reward(result, len(episode.lines)))
        return result


def _episode_reward(result: Any, trajectories: int) -> float | None:
    """The reward of a one-trajectory episode (AReaL's `rewards` tensor of one element); None otherwise."""
    rewards = result.get("rewards") if isinstance(result, dict) else None
    if trajectories != 1 or rewards is None or getattr(rewards, "numel", lambda: 0)() != 1:
        return None
    value = float(rewards.float().reshape(-1)[0])
    return value if math.isfinite(value) else None


class ProrsaInferenceEngine(InferenceEngine):
    """AReaL's inference engine on a Prorsa cluster (see the module doc)."""

    def __init__(
        self,
        config: Any,
        connection: Connection | None = None,
        *,
        task: str = "",
        mode: str = "inflight",
        update_timeout_s: float = 300.0,
    ) -> None:
        """`config`: AReaL's InferenceEngineConfig. `connection`: the cluster (default: `Connection.from_env()` at
        `initialize`). `mode`: how engines take new weights, "inflight" (AReaL's asynchronous RL: running turns go
        on, their tokens stamped) or "drain". Raises ValueError for another mode."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.config = config
        self.connection = connection
        self.task = task
        self.mode = mode
        self.update_timeout_s = update_timeout_s
        self._version = 0
        self._lock = threading.Lock()
        self._executor: WorkflowExecutor | None = None
        self._initialized = False
        self.logger = logging.getLogger("ProrsaInferenceEngine")
        self._last_checkpoint: str | None = None  # the current version's directory (never removed)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def initialize(
        self,
        engine_id: str | None = None,
        addr: str | list[str] | None = None,
        train_data_parallel_size: int | None = None,
    ) -> None:
        """Start AReaL's WorkflowExecutor over this engine. `addr`: the NATS URL, when no Connection was given."""
        if self.connection is None:
            url = addr[0] if isinstance(addr, list) else addr
            self.connection = Connection.from_env(url)
        self.engine_id = engine_id or uuid.uuid4().hex[:8]
        self._executor = WorkflowExecutor(config=self.config, inference_engine=self)
        self._executor.initialize(logger=self.logger, train_data_parallel_size=train_data_parallel_size)
        self._initialized = True

    def destroy(self) -> None:
        """Close the rollout thread's connection (while its loop still runs), then stop AReaL's executor."""
        self._initialized = False
        if self.connection is not None:
            self.connection.close_all()
        if self._executor is not None:
            self._executor.destroy()

    @property
    def initialized(self) -> bool:
        return self._initialized

    @property
    def workflow_executor(self) -> WorkflowExecutor:
        if self._executor is None:
            raise RuntimeError("ProrsaInferenceEngine.initialize() has not been called")
        return self._executor

    def set_version(self, version: int) -> None:
        with self._lock:
            self._version = int(version)

    def get_version(self) -> int:
        with self._lock:
            return self._version

    # -- generation --------------------------------------------------------------------------------------------
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """One model turn on `req.input_ids` (the whole context). Raises ValueError for n_samples != 1 or sampling
        Prorsa cannot honour, RuntimeError when the context leaves no room to generate (as AReaL's engines do),
        NotImplementedError for image inputs, else what `Trajectory.generate` raises."""
        refuse_multimodal(image_data=req.image_data or None, vision_msg_vllm=req.vision_msg_vllm)
        gconfig = req.gconfig
        budget = min(gconfig.max_tokens - len(req.input_ids), gconfig.max_new_tokens)
        if budget <= 0:
            raise RuntimeError(
                f"max_new_tokens ({budget}) is non-positive! max_tokens={gconfig.max_tokens}, "
                f"prompt_len={len(req.input_ids)}, max_new_tokens={gconfig.max_new_tokens}."
            )
        sampling_from_gconfig(gconfig, budget)  # refuse what cannot be honoured before anything is sent
        await self._while_gate_closed()
        client = await self._client()
        episode = CURRENT_EPISODE.get()
        line = episode.place(req.rid, req.input_ids) if episode is not None else None
        if line is None:
            traj = await client.start_trajectory(task=self.task, prompt_tokens=len(req.input_ids))
            line = _Line(traj)
            if episode is not None:
                episode.lines.append(line)
        line.rids.add(req.rid)
        line.busy = True
        started = time.perf_counter()
        try:
            out, logprobs, versions, reason, ttft = await self._turn(
                line, list(req.input_ids), gconfig, budget
            )
        finally:
            line.busy = False
            if episode is None:  # a turn outside any episode is a trajectory of its own
                await line.traj.finish()
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=out,
            output_logprobs=logprobs,
            output_versions=versions,
            stop_reason=reason,
            tokenizer=req.tokenizer,
            processor=req.processor,
            latency=time.perf_counter() - started,
            ttft=ttft,
        )

    async def _turn(
        self, line: _Line, prompt: list[int], gconfig: Any, budget: int
    ) -> tuple[list[int], list[float], list[int], str, float]:
        """Generate up to `budget` tokens, going on after an interruption (finish_reason "abort") with what was
        sampled appended. Returns (ids, logprobs, versions, AReaL stop reason, ttft_s of the first part)."""
        out: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        ttft = math.inf
        while True:
            res = await line.traj.generate(
                prompt + out,
                sampling_from_gconfig(gconfig, budget - len(out)),
                min_policy_version=self._min_version(),
            )
            if math.isinf(ttft):
                ttft = res.ttft_s
            out += res.token_ids
            logprobs += res.logprobs if res.logprobs is not None else [0.0] * len(res.token_ids)
            versions += res.token_versions
            line.context = prompt + out
            if res.finish_reason != "abort":
                return out, logprobs, versions, AREAL_STOP_REASON.get(res.finish_reason, "stop"), ttft
            if len(out) >= budget:  # cut off exactly at its budget: it is complete
                return out, logprobs, versions, "length", ttft
            await self._while_gate_closed()

    def _min_version(self) -> int:
        """The staleness bound a turn names: AReaL's `max_head_offpolicyness` behind the trainer's version."""
        return max(0, self.get_version() - int(getattr(self.config, "max_head_offpolicyness", 0) or 0))

    async def _while_gate_closed(self) -> None:
        while self._executor is not None and self._executor.is_paused():
            await asyncio.sleep(PAUSED_POLL_S)

    async def _client(self) -> RolloutClient:
        if self.connection is None:
            raise RuntimeError("ProrsaInferenceEngine has no cluster: pass a Connection or call initialize()")
        return await self.connection.client()

    # -- the executor's entry points: every workflow runs as Prorsa episodes -------------------------------------
    def submit(
        self,
        data: dict[str, Any],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[dict[str, Any]], bool] | None = None,
        group_size: int = 1,
        task_id: int | None = None,
        is_eval: bool = False,
    ) -> int:
        return self.workflow_executor.submit(
            data,
            workflow=self._episodes(workflow, workflow_kwargs, group_size),
            should_accept_fn=should_accept_fn,
            task_id=task_id,
            is_eval=is_eval,
        )

    def wait(
        self, count: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> list[dict[str, Any] | None]:
        return self.workflow_executor.wait(count, timeout=timeout, raise_timeout=raise_timeout)

    def wait_for_task(
        self, task_id: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> dict[str, Any] | None:
        return self.workflow_executor.wait_for_task(task_id, timeout, raise_timeout)

    def rollout_batch(
        self,
        data: list[dict[str, Any]],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        group_size: int = 1,
    ) -> list[dict[str, Any]]:
        return self.workflow_executor.rollout_batch(
            data=data, workflow=self._episodes(workflow, workflow_kwargs, group_size)
        )

    def prepare_batch(
        self,
        dataloader: Any,
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[dict[str, Any]], bool] | None = None,
        group_size: int = 1,
        dynamic_bs: bool = False,
    ) -> list[dict[str, Any]]:
        return self.workflow_executor.prepare_batch(
            dataloader=dataloader,
            workflow=self._episodes(workflow, workflow_kwargs, group_size),
            should_accept_fn=should_accept_fn,
            dynamic_bs=dynamic_bs,
        )

    def _episodes(self, workflow: Any, kwargs: dict[str, Any] | None, group_size: int) -> RolloutWorkflow:
        """`workflow` (an AReaL RolloutWorkflow instance, class or import path) run as Prorsa episodes, `group_size`
        samples per task. Raises ValueError for a class or path without kwargs, TypeError for anything that is
        not a RolloutWorkflow (AReaL's agent workflows need its OpenAI proxy, which Prorsa's gateway replaces)."""
        from areal.infra.remote_inf_engine import GroupedRolloutWorkflow
        from areal.utils.dynamic_import import import_from_string

        if isinstance(workflow, str):
            workflow = import_from_string(workflow)
        if isinstance(workflow, type) and issubclass(workflow, RolloutWorkflow):
            if kwargs is None:
                raise ValueError(
                    f"workflow_kwargs is required when workflow is a class ({workflow.__name__})"
                )
            workflow = workflow(**kwargs)
        if not isinstance(workflow, RolloutWorkflow):
            raise TypeError(
                f"{type(workflow).__name__} is not an AReaL RolloutWorkflow: agent workflows reach Prorsa through "
                "its OpenAI gateway (`prorsa up` prints it), not through this engine"
            )
        # Each sample of a group is an episode of its own (one trajectory, its own reward).
        episodes = ProrsaEpisodes(workflow)
        return GroupedRolloutWorkflow(episodes, group_size, self.logger) if group_size > 1 else episodes

    def pause(self) -> None:
        """Close the executor's submission gate (no new episode starts, and running ones start no new turn)."""
        self.workflow_executor.pause()

    def resume(self) -> None:
        self.workflow_executor.resume()

    # -- weights and generation control ------------------------------------------------------------------------
    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> concurrent.futures.Future[None]:
        """Serve the checkpoint at `meta.path` as version `meta.version` (default: get_version() + 1) on every
        engine; the Future completes when every live engine serves it and raises WeightUpdateError naming those
        that do not (see the module doc). Raises ValueError for a meta that is not a disk update or has no path."""
        if meta.type != "disk" or not meta.path:
            raise ValueError(
                f"Prorsa loads weights from a checkpoint directory: need type 'disk' and a path, got {meta}"
            )
        version = meta.version if meta.version is not None else self.get_version() + 1
        saved_key = self._saved_key()
        return _in_thread(self._update_weights(meta, int(version), saved_key), name="prorsa-weights")

    def _saved_key(self) -> str | None:
        """AReaL's name_resolve record a trainer adds once the checkpoint is written (None: no experiment named)."""
        exp, trial = getattr(self.config, "experiment_name", None), getattr(self.config, "trial_name", None)
        if not exp or not trial:
            return None
        from areal.utils import names

        return names.update_weights_from_disk(exp, trial, self.get_version())

    async def _update_weights(self, meta: WeightUpdateMeta, version: int, saved_key: str | None) -> None:
        if saved_key is not None:
            from areal.utils import name_resolve

            wait_s = self.update_timeout_s
            await asyncio.to_thread(name_resolve.wait, saved_key, timeout=wait_s)
        assert self.connection is not None
        started = time.perf_counter()
        async with self.connection.session() as client:
            await client.update_weights(
                version, str(meta.path), timeout_s=self.update_timeout_s, mode=self.mode
            )
        self.logger.info(
            "version %d served by every engine in %.2f s", version, time.perf_counter() - started
        )
        previous, self._last_checkpoint = self._last_checkpoint, str(meta.path)
        if meta.clear_checkpoint_after_load and previous and previous != self._last_checkpoint:
            shutil.rmtree(previous, ignore_errors=True)

    def pause_generation(self) -> None:
        """Pause generation on the whole cluster; returns once every live engine reports paused."""
        self._control(lambda client: client.pause("areal pause_generation"))

    def continue_generation(self) -> None:
        self._control(lambda client: client.resume("areal continue_generation"))

    def _control(self, call: Callable[[RolloutClient], Coroutine[Any, Any, Any]]) -> None:
        assert self.connection is not None, "initialize() first"
        connection = self.connection

        async def run() -> None:
            async with connection.session() as client:
                await call(client)

        _in_thread(run(), name="prorsa-control").result()

    def offload(self) -> None:
        return None  # the engines are not on the trainer's devices

    def onload(self, tags: list[str] | None = None) -> None:
        return None

    def export_stats(self) -> dict[str, float]:
        """What the workflows recorded (rewards, turns), as AReaL's remote engines export it."""
        from areal.utils import stats_tracker

        return stats_tracker.export_all(reduce_group=None)

    # -- what Prorsa does not offer --------------------------------------------------------------------------
    def launch_server(self, server_args: dict[str, Any]) -> Any:
        raise NotImplementedError(
            "Prorsa engines run as a cluster: start it with `prorsa up` and connect to it"
        )

    def teardown_server(self) -> None:
        return None  # nothing was launched

    def init_weights_update_group(self, meta: WeightUpdateMeta, rank_ids: list[int] | None = None) -> Any:
        raise NotImplementedError(
            "Prorsa engines load weights from a checkpoint directory: use update_weights_from_disk"
        )

    def update_weights_from_distributed(self, meta: WeightUpdateMeta, param_specs: list[Any]) -> Any:
        raise NotImplementedError(
            "Prorsa engines load weights from a checkpoint directory: use update_weights_from_disk"
        )


def _in_thread(coro: Coroutine[Any, Any, Any], name: str) -> concurrent.futures.Future[Any]:
    """Run `coro` in a fresh event loop on a thread of its own (the caller may be inside a running loop, or
    AReaL's main thread with none); the Future holds its result or exception."""
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def target() -> None:
        try:
            fut.set_result(asyncio.run(coro))
        except BaseException as exc:  # handed to whoever waits on the Future
            fut.set_exception(exc)

    threading.Thread(target=target, name=name, daemon=True).start()
    return fut

"""Two RL steps of AReaL's own orchestration on a Prorsa cluster, a weight update between them.

    .venv-trainers/bin/python -m tests.trainers.areal_rl_steps --workdir DIR    # after `source trainer.env`

Runs in the trainers' environment (`make trainers`). AReaL's `WorkflowExecutor` (built by
`ProrsaInferenceEngine.initialize`, running episodes in its own thread and event loop) drives AReaL's own
`MultiTurnWorkflow` (a question retried until the reward accepts: here from the third attempt on) and
`RLVRWorkflow` (two samples per prompt, `group_size=2`). Between the steps the test plays AReaL's trainer, in the
order `rl_trainer.py` and `fsdp_engine.py` call the engine: pause, pause_generation, update_weights_from_disk (the
future waits for the "saved" record), write the checkpoint, add the record, wait, continue_generation,
set_version, resume. Last, a workflow that raises after its first turn. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TASK = "areal-test"
ACCEPT_FROM_TURN = 3
EXPERIMENT, TRIAL = "prorsa-test", "t0"


def reward_fn(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any
) -> float:
    """MultiTurnWorkflow's reward: 1.0 from the episode's third attempt on (AReaL runs this in a worker process: the
    count travels in the prompt, which grows by one amendment per attempt); RLVR's: 1.0 always."""
    if data.get("kind") == "rlvr":
        return 1.0
    return 1.0 if prompt.count("<|im_start|> assistant") >= ACCEPT_FROM_TURN else 0.0


def workflows(tokenizer: Any) -> tuple[Any, Any, Any]:
    from areal.api import RolloutWorkflow
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest
    from areal.workflow.multi_turn import MultiTurnWorkflow
    from areal.workflow.rlvr import RLVRWorkflow

    gconfig = GenerationHyperparameters(max_new_tokens=12, temperature=1.0)
    multi = MultiTurnWorkflow(
        reward_fn=reward_fn, gconfig=gconfig, tokenizer=tokenizer, max_turns=5, turn_discount=0.9
    )
    rlvr = RLVRWorkflow(reward_fn=reward_fn, gconfig=gconfig, tokenizer=tokenizer)

    class FailingWorkflow(RolloutWorkflow):
        """One model turn, then a crash, as a workflow with a bug does."""

        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
            req = ModelRequest(
                input_ids=[300, 301, 302], gconfig=gconfig.new(n_samples=1), tokenizer=tokenizer
            )
            await engine.agenerate(req)
            raise RuntimeError("the environment crashed after the first turn")

    return multi, rlvr, FailingWorkflow()


def summary(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per trajectory row: the versions of its output tokens (loss_mask 1) and of the rest, and its reward."""
    rows = []
    for traj in batch:
        for i in range(traj["input_ids"].shape[0]):
            n = int(traj["attention_mask"][i].sum())
            mask = traj["loss_mask"][i][:n].tolist()
            versions = traj["versions"][i][:n].tolist()
            rows.append(
                {
                    "output_versions": sorted({v for v, m in zip(versions, mask, strict=True) if m}),
                    "other_versions": sorted({v for v, m in zip(versions, mask, strict=True) if not m}),
                    "outputs": sum(mask),
                    "reward": float(traj["rewards"][i]),
                }
            )
    return rows


def main(workdir: Path) -> dict[str, Any]:
    from areal.api.cli_args import InferenceEngineConfig, NameResolveConfig
    from areal.api.io_struct import WeightUpdateMeta
    from areal.utils import name_resolve, names

    from prorsa.trainers.areal import ProrsaInferenceEngine
    from prorsa.trainers.checkpoint import save_checkpoint
    from prorsa.trainers.connection import Connection
    from tests.trainers.tiny_tokenizer import build_tokenizer
    from tests.trainers.verl_rl_steps import new_weights, write_model

    model_dir = workdir / "model"
    write_model(model_dir)
    fileroot = Path(os.environ["PRORSA_WEIGHTS_ROOT"]) / "areal"  # AReaL writes its weight updates under it
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(workdir / "name_resolve")))
    config = InferenceEngineConfig(
        experiment_name=EXPERIMENT,
        trial_name=TRIAL,
        fileroot=str(fileroot),
        max_concurrent_rollouts=8,
        consumer_batch_size=8,  # AReaL admits (version + 1 + max_head_offpolicyness) x this many episodes
        max_head_offpolicyness=0,
    )
    engine = ProrsaInferenceEngine(config, Connection.from_env(retry_after_s=60.0), task=TASK)
    engine.initialize()
    multi, rlvr, failing = workflows(build_tokenizer())
    question = [
        {"messages": [{"role": "user", "content": f"t{500 + i} t{501 + i} t{502 + i}"}]} for i in (0, 10)
    ]
    grouped = [{"messages": q["messages"], "kind": "rlvr"} for q in question]
    out: dict[str, Any] = {}
    try:
        out["step1"] = summary(engine.rollout_batch(question, workflow=multi))
        out["step1"] += summary(engine.rollout_batch(grouped, workflow=rlvr, group_size=2))

        # AReaL's trainer between two steps (rl_trainer.py, fsdp_engine._update_weights_from_disk).
        t0 = time.monotonic()
        engine.pause()
        engine.pause_generation()
        meta = WeightUpdateMeta.from_disk(EXPERIMENT, TRIAL, str(fileroot)).with_version(1)
        future = engine.update_weights_from_disk(meta)
        save_checkpoint(new_weights(model_dir, 1), meta.path, str(model_dir))
        name_resolve.add(
            names.update_weights_from_disk(EXPERIMENT, TRIAL, engine.get_version()), str(time.time())
        )
        future.result(timeout=120)
        engine.continue_generation()
        engine.set_version(1)
        engine.resume()
        out["update_s"] = time.monotonic() - t0
        out["checkpoint"] = str(meta.path)

        out["step2"] = summary(engine.rollout_batch(question, workflow=multi))
        out["step2"] += summary(engine.rollout_batch(grouped, workflow=rlvr, group_size=2))
        # AReaL drops a failed episode (its executor logs the error and never delivers a result): wait briefly. The
        # episode's trajectory is finished before the error leaves the episode, so the bus has it by then.
        task = engine.submit(question[0], workflow=failing)
        out["failing"] = engine.wait_for_task(task, timeout=3.0, raise_timeout=False)
    finally:
        engine.destroy()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, type=Path)
    args = p.parse_args()
    print(json.dumps(main(args.workdir)))
    sys.exit(0)

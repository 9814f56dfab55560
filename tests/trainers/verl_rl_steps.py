"""Two RL steps of verl's own orchestration on a Prorsa cluster, a weight update between them.

    .venv-trainers/bin/python -m tests.trainers.verl_rl_steps --workdir DIR    # after `source trainer.env`

Runs in the trainers' environment (`make trainers`), as a verl trainer's driver does, under `ray.init(num_cpus=2)`:
verl's config (its own `ppo_trainer` defaults, composed by hydra, with `rollout.name=prorsa`), verl's own
`LLMServerManager` building the replica from its registry, verl's own `AgentLoopManager` with two `AgentLoopWorker` Ray
actors, each unpickling the `ProrsaLLMClient` and connecting from its own process. The batch mixes verl's
`single_turn_agent` and `tool_agent`, both wrapped by `ProrsaAgentLoop`. Between the steps the "trainer" changes
the weights and the replica writes them under the weights root and waits for every engine to serve version 1.
Last, a batch of loops that raise after their first turn (tests/trainers/verl_env.py). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TASK = "verl-test"
TURN_TOKENS = 16  # the output budget of every turn
AGENTS = ["prorsa_single_turn_agent", "prorsa_tool_agent", "prorsa_single_turn_agent", "prorsa_tool_agent"]
ROOT = Path(__file__).resolve().parent.parent.parent


def write_model(model_dir: Path) -> None:
    """A tiny model directory verl's HFModelConfig loads: the tests' word-level tokenizer over the simulated
    engines' vocabulary and a one-layer Llama config (a model type verl's default Continuous Token builder takes)."""
    from transformers import LlamaConfig

    from tests.trainers.tiny_tokenizer import VOCAB_SIZE, build_tokenizer

    build_tokenizer().save_pretrained(model_dir)
    LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(model_dir)


def write_registries(workdir: Path) -> tuple[Path, Path]:
    """verl's agent-loop registry (Prorsa's two entries plus the failing loop, wrapped) and its tool config."""
    from prorsa.trainers.verl_agent_loop import AGENT_LOOP_CONFIG

    loops = workdir / "agent_loops.yaml"
    loops.write_text(
        AGENT_LOOP_CONFIG.read_text()
        + "- name: failing_agent\n  _target_: tests.trainers.verl_env.FailingAgentLoop\n"
        + "- name: prorsa_failing_agent\n"
        + "  _target_: prorsa.trainers.verl_agent_loop.ProrsaAgentLoop\n  agent: failing_agent\n"
    )
    tools = workdir / "tools.yaml"
    tools.write_text(
        "tools:\n"
        "  - class_name: tests.trainers.verl_env.StepTool\n"
        "    config: {type: native}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: step\n"
        "        description: advance the environment\n"
        "        parameters: {type: object, properties: {}, required: []}\n"
    )
    return loops, tools


def verl_config(model_dir: Path, loops: Path, tools: Path, weights_root: Path) -> Any:
    from hydra import compose, initialize_config_dir
    from verl.trainer import config as verl_config_pkg

    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=prorsa",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.nnodes=1",  # standalone: one replica of one "GPU" (it holds none)
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.prompt_length=256",
        "actor_rollout_ref.rollout.response_length=256",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        "actor_rollout_ref.rollout.multi_turn.format=prorsa_test_env",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.multi_turn.max_user_turns=3",
        f"+actor_rollout_ref.rollout.custom={{prorsa: {{task: {TASK}, weights_root: '{weights_root}', update_timeout_s: 20}}}}",
        "trainer.n_gpus_per_node=1",
    ]
    with initialize_config_dir(config_dir=os.path.dirname(verl_config_pkg.__file__), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def batch_of(agents: list[str]) -> Any:
    import numpy as np
    from verl.protocol import DataProto

    raw_prompt = np.empty(len(agents), dtype=object)  # one message list per sample (np.array would nest them)
    for i in range(len(agents)):
        raw_prompt[i] = [{"role": "user", "content": f"t{300 + 10 * i} t{301 + 10 * i} t{302 + 10 * i}"}]
    return DataProto.from_dict(
        non_tensors={"raw_prompt": raw_prompt, "agent_name": np.array(agents, dtype=object)}
    )


def summary(out: Any) -> list[dict[str, Any]]:
    """Per sample: its loop, the per-token versions aligned with the response, and the response mask."""
    rows = []
    masks = out.batch["response_mask"].tolist()
    for i, name in enumerate(out.non_tensor_batch["agent_name"]):
        versions = list(out.non_tensor_batch["token_versions"][i])
        rows.append(
            {
                "agent": str(name),
                "turns": int(out.non_tensor_batch["__num_turns__"][i]),
                "versions": versions,
                "mask": masks[i][: len(versions)],
                "padding_mask": masks[i][len(versions) :],
                "min_global_steps": int(out.non_tensor_batch["min_global_steps"][i]),
                "max_global_steps": int(out.non_tensor_batch["max_global_steps"][i]),
            }
        )
    return rows


def new_weights(model_dir: Path, step: int) -> dict[str, Any]:
    """What a trainer step hands the replica: the tiny model's tensors, changed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(step)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * step)
    return model.state_dict()


def main(workdir: Path) -> dict[str, Any]:
    import ray
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.workers.rollout.llm_server import LLMServerManager

    import prorsa.trainers.verl_replica  # noqa: F401 - registers rollout.name=prorsa, as a trainer's entry point does
    from prorsa.trainers.verl import ProrsaLLMClient

    model_dir, weights_root = workdir / "model", Path(os.environ["PRORSA_WEIGHTS_ROOT"])
    write_model(model_dir)
    loops, tools = write_registries(workdir)
    config = verl_config(model_dir, loops, tools, weights_root)

    client = ProrsaLLMClient.from_config(config)
    client.max_tokens = TURN_TOKENS
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 * 1024 * 1024,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "VERL_LOGGING_LEVEL": "ERROR"}},
    )
    try:
        # verl's own server manager builds the replicas of `rollout.name` from its registry (RayPPOTrainer does
        # the same with its actor worker group: init_hybrid instead of init_standalone).
        servers = LLMServerManager.create(config=config)
        (replica,) = servers.get_replicas()
        out: dict[str, Any] = {"replica": type(replica).__name__, "server_address": replica.server_address}
        manager = AgentLoopManager.create(config=config, llm_client=client)
        t0 = time.monotonic()
        out["step1"] = summary(manager.generate_sequences(batch_of(AGENTS)))
        out["step1_s"] = time.monotonic() - t0
        print(json.dumps(out), file=sys.stderr, flush=True)
        ack = asyncio.run(replica.update_weights(1, weights=new_weights(model_dir, 1)))
        out["ack"] = {"version": ack.version, "source": ack.source, "engines": ack.engines}
        out["step2"] = summary(manager.generate_sequences(batch_of(AGENTS)))
        try:
            # verl splits a batch evenly over its workers: one crashing loop in each.
            manager.generate_sequences(batch_of(["prorsa_failing_agent"] * 2))
            out["failing"] = {"error": None, "agent_bug": False}
        except Exception as exc:  # Ray wraps the loop's AgentBug in a RayTaskError
            out["failing"] = {"error": type(exc).__name__, "agent_bug": "AgentBug" in str(exc)}
    finally:
        ray.shutdown()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, type=Path)
    args = p.parse_args()
    print(json.dumps(main(args.workdir)))
    sys.exit(0)

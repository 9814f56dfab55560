"""Our integrations against the installed verl and AReaL: what their orchestration calls on ours must exist with
their signature, and what we call and read on theirs must exist. Run in the trainers' environment; prints one line
per mismatch and exits 1 if there is any (`tests/test_trainers.py` runs it), so a new release's drift is caught.

    .venv-trainers/bin/python -m tests.trainers.signatures
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any


def _params(fn: object) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def _takes_var_keyword(params: dict[str, inspect.Parameter]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _accepts(theirs: Any, ours: Any, label: str) -> list[str]:
    """Every named parameter of `theirs` is one of `ours`, of the same kind (or swallowed by our **kwargs)."""
    out = []
    mine, their_params = _params(ours), _params(theirs)
    if all(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for n, p in their_params.items() if n != "self"):
        return []  # a placeholder signature (`initialize(self, *args, **kwargs)`): each engine names its own
    for name, p in their_params.items():
        if p.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
            if p.kind is inspect.Parameter.VAR_KEYWORD and not _takes_var_keyword(mine):
                out.append(f"{label}: theirs takes **{name}; ours does not")
            continue
        if name not in mine:
            if not _takes_var_keyword(mine):
                out.append(f"{label}: theirs takes `{name}`; ours does not")
        elif mine[name].kind != p.kind:
            out.append(f"{label}: `{name}` is {p.kind.description} there, {mine[name].kind.description} here")
    return out


def verl_problems() -> list[str]:
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopManager
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import RolloutReplica
    from verl.workers.rollout.replica import TokenOutput as VerlTokenOutput

    from prorsa.trainers.verl import ProrsaLLMClient, TokenOutput
    from prorsa.trainers.verl_agent_loop import ProrsaAgentLoop, ProrsaAgentLoopManager
    from prorsa.trainers.verl_replica import ProrsaReplica

    out = _accepts(LLMServerClient.generate, ProrsaLLMClient.generate, "verl LLMServerClient.generate")
    out += _accepts(AgentLoopManager.__init__, ProrsaAgentLoopManager.__init__, "verl AgentLoopManager()")
    out += _accepts(AgentLoopBase.run, ProrsaAgentLoop.run, "verl AgentLoopBase.run")
    their_fields = set(VerlTokenOutput.model_fields)
    our_fields = {f.name for f in dataclasses.fields(TokenOutput)}
    if their_fields ^ our_fields:
        out.append(f"TokenOutput fields differ: only verl's {sorted(their_fields - our_fields)}, only ours "
                   f"{sorted(our_fields - their_fields)}")  # fmt: skip
    # RolloutReplica's own coroutines act on verl-launched servers (`server.X.remote()`): each must be ours.
    for name, fn in vars(RolloutReplica).items():
        if not inspect.iscoroutinefunction(fn):
            continue
        if name not in vars(ProrsaReplica):
            out.append(f"verl RolloutReplica.{name} is not overridden by ProrsaReplica")
        else:
            out += _accepts(fn, vars(ProrsaReplica)[name], f"verl RolloutReplica.{name}")
    return out


# InferenceEngine methods left to AReaL's base on purpose (it raises NotImplementedError with its own message).
AREAL_NOT_OFFERED = {"compute_logp"}


def areal_problems() -> list[str]:
    from areal.api import InferenceEngine
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta
    from areal.infra.workflow_executor import WorkflowExecutor

    from prorsa.trainers.areal import ProrsaInferenceEngine

    out = []
    for name, fn in vars(InferenceEngine).items():
        if name.startswith("_") or not callable(fn) or name in AREAL_NOT_OFFERED:
            continue
        if "raise NotImplementedError" in inspect.getsource(fn) and name not in vars(ProrsaInferenceEngine):
            out.append(f"AReaL InferenceEngine.{name} is not overridden by ProrsaInferenceEngine")
        elif name in vars(ProrsaInferenceEngine):
            out += _accepts(fn, vars(ProrsaInferenceEngine)[name], f"AReaL InferenceEngine.{name}")
    for prop in ("initialized", "workflow_executor"):
        if not isinstance(vars(ProrsaInferenceEngine).get(prop), property):
            out.append(f"ProrsaInferenceEngine.{prop} is not a property, as AReaL's is")
    reads = {
        GenerationHyperparameters: ("n_samples", "max_new_tokens", "max_tokens", "greedy", "temperature", "top_p",
                                    "top_k", "stop_token_ids", "ignore_eos", "stop", "frequency_penalty",
                                    "min_new_tokens", "use_beam_search"),
        ModelRequest: ("rid", "input_ids", "gconfig", "tokenizer", "processor", "image_data", "vision_msg_vllm"),
        WeightUpdateMeta: ("type", "path", "version", "clear_checkpoint_after_load"),
    }  # fmt: skip
    for cls, names in reads.items():
        have = {f.name for f in dataclasses.fields(cls)}
        out += [
            f"AReaL {cls.__name__} has no `{n}` (ProrsaInferenceEngine reads it)"
            for n in names
            if n not in have
        ]
    passed = ("input_tokens", "output_tokens", "output_logprobs", "output_versions", "stop_reason", "tokenizer",
              "processor", "latency", "ttft")  # fmt: skip
    have = {f.name for f in dataclasses.fields(ModelResponse)}
    out += [
        f"AReaL ModelResponse has no `{n}` (ProrsaInferenceEngine sets it)" for n in passed if n not in have
    ]
    for name in ("config", "inference_engine"):
        if name not in _params(WorkflowExecutor.__init__):
            out.append(
                f"AReaL WorkflowExecutor() takes no `{name}` (ProrsaInferenceEngine.initialize passes it)"
            )
    return out


def swap_problems() -> list[str]:
    """What verl's trainer does with `agent_loop_manager_class`: load the class by name and build it with the
    client of its LLMServerManager; ours must end up holding Prorsa's client (built from the config)."""
    from omegaconf import OmegaConf
    from verl.utils.import_utils import load_class_from_fqn

    from prorsa.trainers.verl import ProrsaLLMClient

    fqn = "prorsa.trainers.verl_agent_loop.ProrsaAgentLoopManager"
    rollout = {"response_length": 48, "custom": {"prorsa": {"nats_url": "nats://127.0.0.1:1", "task": "t"}}}
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout, "model": {}}})
    manager = load_class_from_fqn(fqn, "AgentLoopManager")(config=config, llm_client=object())
    client = manager.llm_client
    if not isinstance(client, ProrsaLLMClient) or client.max_tokens != 48 or client.task != "t":
        return [f"ProrsaAgentLoopManager did not swap in Prorsa's client from the config: {client!r}"]
    return []


if __name__ == "__main__":
    problems = verl_problems() + areal_problems() + swap_problems()
    for line in problems:
        print(line)
    print(f"{len(problems)} mismatches between prorsa.trainers and the installed verl/AReaL")
    sys.exit(1 if problems else 0)

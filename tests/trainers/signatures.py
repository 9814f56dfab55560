"""Our adapters against the installed verl and AReaL: what their rollout code calls and reads must exist on our
side, and what we call and read must exist on theirs. Run in the trainers' environment; prints one line per
mismatch and exits 1 if there is any (`tests/test_trainers.py` runs it), so a new release's drift is caught.

    .venv-trainers/bin/python -m tests.trainers.signatures
"""

from __future__ import annotations

import dataclasses
import inspect
import sys


def _params(fn: object) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def _takes_var_keyword(params: dict[str, inspect.Parameter]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def verl_problems() -> list[str]:
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import TokenOutput as VerlTokenOutput

    from prorsa.client.adapters import TokenOutput, VerlServerManager

    out = []
    theirs, ours = _params(LLMServerClient.generate), _params(VerlServerManager.generate)
    for name, p in theirs.items():
        if p.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
            continue
        if name not in ours:
            out.append(f"verl LLMServerClient.generate takes `{name}`; VerlServerManager.generate does not")
        elif ours[name].kind != p.kind:
            out.append(
                f"verl passes `{name}` as {p.kind.description}; ours takes it as {ours[name].kind.description}"
            )
    if _takes_var_keyword(theirs) and not _takes_var_keyword(ours):
        out.append(
            "verl LLMServerClient.generate takes **kwargs (priority, mm_processor_output); ours does not"
        )
    their_fields = set(VerlTokenOutput.model_fields)
    our_fields = {f.name for f in dataclasses.fields(TokenOutput)}
    if their_fields - our_fields:
        out.append(f"verl TokenOutput fields our TokenOutput lacks: {sorted(their_fields - our_fields)}")
    if our_fields - their_fields:
        out.append(f"our TokenOutput fields verl's lacks: {sorted(our_fields - their_fields)}")
    return out


def areal_problems() -> list[str]:
    from areal.api import InferenceEngine, RolloutWorkflow
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest, ModelResponse

    from prorsa.client.adapters import ArealEngine, ProrsaWorkflow

    out = []
    if list(_params(InferenceEngine.agenerate)) != list(_params(ArealEngine.agenerate)):
        out.append(
            f"AReaL InferenceEngine.agenerate{inspect.signature(InferenceEngine.agenerate)} vs "
            f"ArealEngine.agenerate{inspect.signature(ArealEngine.agenerate)}"
        )
    if list(_params(RolloutWorkflow.arun_episode)) != list(_params(ProrsaWorkflow.arun_episode)):
        out.append(
            f"AReaL RolloutWorkflow.arun_episode{inspect.signature(RolloutWorkflow.arun_episode)} vs "
            f"ProrsaWorkflow.arun_episode{inspect.signature(ProrsaWorkflow.arun_episode)}"
        )
    reads = {
        GenerationHyperparameters: (
            "n_samples", "max_new_tokens", "greedy", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos",
        ),
        ModelRequest: ("input_ids", "gconfig", "tokenizer", "image_data", "vision_msg_vllm"),
    }  # fmt: skip
    for cls, names in reads.items():
        have = {f.name for f in dataclasses.fields(cls)}
        out += [f"AReaL {cls.__name__} has no `{n}` (ArealEngine reads it)" for n in names if n not in have]
    passed = ("input_tokens", "output_tokens", "output_logprobs", "output_versions", "stop_reason", "tokenizer",
              "latency", "ttft")  # fmt: skip
    have = {f.name for f in dataclasses.fields(ModelResponse)}
    out += [f"AReaL ModelResponse has no `{n}` (ArealEngine sets it)" for n in passed if n not in have]
    return out


if __name__ == "__main__":
    problems = verl_problems() + areal_problems()
    for line in problems:
        print(line)
    print(f"{len(problems)} mismatches between prorsa.client.adapters and the installed verl/AReaL")
    sys.exit(1 if problems else 0)

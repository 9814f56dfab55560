"""A GRPO-shaped RL loop on real weights: roll out on Prorsa's vLLM engines, train with torch, update, roll out again.

    prorsa tiny-model /tmp/tiny                                   # a small random Qwen2 (no model hub needed)
    PRORSA_WEIGHTS_ROOT=/tmp/ckpt prorsa up --backend vllm --model /tmp/tiny --dtype float32 --engines 1 \\
        --secrets-dir /tmp/prorsa-secrets                         # in another terminal; engines load from /tmp/ckpt
    source /tmp/prorsa-secrets/trainer.env
    python examples/grpo_tiny.py --model /tmp/tiny --weights-root /tmp/ckpt

Each step: for every prompt a group of samples (one Prorsa trajectory each, its `group` naming the prompt) on the
engines; a toy reward (the share of output tokens in the lower half of the vocabulary); group-relative advantages
(reward minus the group's mean, over its standard deviation); one optimizer step on a PPO-clipped surrogate whose
old log-probabilities are the ones the engine sampled with (the trainer recomputes them first and prints the gap:
token-exact rollouts make it numerically zero); the new weights saved as a model directory under the weights root
(`prorsa.trainers.checkpoint`); `update_weights`, which returns once every engine serves the new version. Then it
rolls out again and prints the new version's tokens with the version of each, and a greedy probe before and after.

The trainer is the model in a process of its own (torch, transformers); the engines never see it but through the
checkpoint. `--json F` writes what it printed, for tests/test_grpo_example.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from prorsa.client.client import RolloutClient
from prorsa.client.stream import GenerateResult
from prorsa.trainers.checkpoint import save_checkpoint
from prorsa.trainers.connection import Connection
from proto import SamplingParams


@dataclass(frozen=True)
class Sample:
    prompt: list[int]
    out: GenerateResult
    reward: float


def toy_reward(tokens: list[int], vocab_size: int) -> float:
    """The share of tokens in the lower half of the vocabulary: something the policy can learn to raise."""
    return sum(1 for t in tokens if t < vocab_size // 2) / max(1, len(tokens))


async def rollout(
    client: RolloutClient,
    prompts: list[list[int]],
    group: int,
    params: SamplingParams,
    vocab: int,
    tag: str,
    seed: int,
) -> list[list[Sample]]:
    """One trajectory per sample, `group` samples per prompt, all at once; each finished with its reward. Sample k
    draws with seed `seed + k`, so a run is repeatable."""

    async def one(p: int, g: int) -> Sample:
        traj = await client.start_trajectory(
            task="grpo-tiny", group=f"{tag}-p{p}", prompt_tokens=len(prompts[p])
        )
        out = await traj.generate(prompts[p], msgspec.structs.replace(params, seed=seed + p * group + g))
        sample = Sample(prompts[p], out, toy_reward(out.token_ids, vocab))
        await traj.finish(reward=sample.reward)
        return sample

    flat = await asyncio.gather(*(one(p, g) for p in range(len(prompts)) for g in range(group)))
    return [list(flat[p * group : (p + 1) * group]) for p in range(len(prompts))]


def advantages(groups: list[list[Sample]]) -> list[list[float]]:
    """GRPO's group-relative advantage: (reward - group mean) / (group std + eps)."""
    out = []
    for samples in groups:
        rewards = [s.reward for s in samples]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        out.append([(r - mean) / (std + 1e-6) for r in rewards])
    return out


def train_step(model: Any, optimizer: Any, groups: list[list[Sample]], clip: float = 0.2) -> dict[str, float]:
    """One optimizer step on the clipped surrogate, token-level mean over every output token, gradients clipped to
    norm 1. Returns the loss, the gradient's norm and the largest gap between the trainer's log-probabilities and
    the engine's, before the step. (On-policy the ratio is 1, so the loss is the advantages' mean, about 0; the
    gradient is what moves the policy.)"""
    import torch

    model.train()
    losses, gaps, tokens = [], [0.0], 0
    for samples, advs in zip(groups, advantages(groups), strict=True):
        for s, adv in zip(samples, advs, strict=True):
            if not s.out.token_ids:
                continue
            ids = torch.tensor([s.prompt + s.out.token_ids])
            logits = model(input_ids=ids).logits[0, len(s.prompt) - 1 : -1].float()
            target = torch.tensor(s.out.token_ids)
            logp = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
            old = torch.tensor(s.out.logprobs, dtype=torch.float32)
            gaps.append(float((logp.detach() - old).abs().max()))
            ratio = torch.exp(logp - old)
            surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
            losses.append(-surrogate.sum())
            tokens += len(s.out.token_ids)
    loss = torch.stack(losses).sum() / max(1, tokens)
    optimizer.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {"loss": float(loss.detach()), "grad_norm": float(grad_norm), "logprob_gap": max(gaps)}


async def greedy(client: RolloutClient, prompt: list[int], max_tokens: int) -> GenerateResult:
    traj = await client.start_trajectory(task="grpo-tiny-probe", prompt_tokens=len(prompt))
    out = await traj.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    await traj.finish()
    return out


def _versions(groups: list[list[Sample]]) -> list[int]:
    return sorted({v for samples in groups for s in samples for v in s.out.token_versions})


def _mean_reward(groups: list[list[Sample]]) -> float:
    return statistics.fmean(s.reward for samples in groups for s in samples)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    vocab = model.config.vocab_size
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    prompts = [[rng.randrange(100, vocab) for _ in range(12)] for _ in range(args.prompts)]
    probe = [rng.randrange(100, vocab) for _ in range(12)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True, logprobs=True)
    root = Path(args.weights_root) / "grpo-tiny"

    conn = Connection.from_env(retry_after_s=120.0)
    client = await conn.client()
    report: dict[str, Any] = {"steps": [], "probe": []}
    try:
        before = await greedy(client, probe, args.max_tokens)
        report["probe"].append({"versions": before.token_versions, "tokens": before.token_ids})
        print(f"probe (greedy) on version {before.token_versions[0]}: {before.token_ids}")
        version = before.token_versions[0]
        for step in range(args.steps):
            groups = await rollout(
                client, prompts, args.group, params, vocab, f"s{step}", args.seed + 1000 * step
            )
            stats = train_step(model, optimizer, groups)
            version += 1
            t0 = time.monotonic()
            path = save_checkpoint(model.state_dict(), root / f"v{version}", args.model)
            ack = await client.update_weights(version, str(path), timeout_s=args.update_timeout_s)
            row = {
                "served_versions": _versions(groups),
                "mean_reward": _mean_reward(groups),
                **stats,
                "new_version": ack.version,
                "engines": ack.engines,
                "update_s": time.monotonic() - t0,
            }
            report["steps"].append(row)
            print(
                f"step {step}: rolled out {args.prompts}x{args.group} on version(s) {row['served_versions']}, "
                f"mean reward {row['mean_reward']:.3f}, engine-vs-trainer logprob gap {row['logprob_gap']:.2e}, "
                f"gradient norm {row['grad_norm']:.3f}; version {ack.version} saved at {path} and served by "
                f"{sorted(ack.engines)} after {row['update_s']:.1f} s"
            )
        after = await rollout(
            client, prompts, args.group, params, vocab, "final", args.seed + 1000 * args.steps
        )
        first = after[0][0].out
        report["final"] = {
            "served_versions": _versions(after),
            "mean_reward": _mean_reward(after),
            "tokens": first.token_ids,
            "token_versions": first.token_versions,
        }
        print(f"rolled out again on version(s) {report['final']['served_versions']}, mean reward "
              f"{report['final']['mean_reward']:.3f}; first sample: tokens {first.token_ids}, versions "
              f"{first.token_versions}")  # fmt: skip
        now = await greedy(client, probe, args.max_tokens)
        report["probe"].append({"versions": now.token_versions, "tokens": now.token_ids})
        changed = sum(a != b for a, b in zip(before.token_ids, now.token_ids, strict=False))
        report["probe_changed"] = changed
        print(f"probe (greedy) on version {now.token_versions[0]}: {now.token_ids} ({changed} of "
              f"{len(now.token_ids)} tokens changed)")  # fmt: skip
    finally:
        await conn.close()
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", required=True, help="the model directory the engines serve (`prorsa tiny-model`)"
    )
    p.add_argument(
        "--weights-root",
        default=os.environ.get("PRORSA_WEIGHTS_ROOT", ""),
        help="the engines' weights root: new checkpoints go under it (default: $PRORSA_WEIGHTS_ROOT)",
    )
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4, help="samples per prompt (GRPO's group)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--update-timeout-s", type=float, default=300.0)
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args()
    if not args.weights_root:
        p.error("--weights-root (or PRORSA_WEIGHTS_ROOT): the directory the engines load checkpoints from")
    if args.group < 2:
        p.error("--group must be at least 2: GRPO compares the samples of one prompt")
    report = asyncio.run(run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(report))


if __name__ == "__main__":
    main()

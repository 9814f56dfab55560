"""`ProrsaAgentLoop`: verl's agent loops, each run as one Prorsa episode whose trajectories are always finished.

verl builds an agent loop per sample from its registry (`hydra.utils.instantiate` of a `_target_`), runs it, and
never tells the rollout backend that the trajectory ended. This loop is a registry entry that wraps another one:

    # the registry file verl reads (rollout.agent.agent_loop_config_path; `AGENT_LOOP_CONFIG` ships these two)
    - name: prorsa_tool_agent
      _target_: prorsa.trainers.verl_agent_loop.ProrsaAgentLoop
      agent: tool_agent            # any registered loop: verl's, or a user's own

    actor_rollout_ref.rollout.agent.agent_loop_config_path=$(python -c 'import prorsa.trainers.verl_agent_loop as m; print(m.AGENT_LOOP_CONFIG)')
    actor_rollout_ref.rollout.agent.default_agent_loop=prorsa_tool_agent

It builds the wrapped loop with the same arguments verl gave it, runs it inside an `Episode` (a context variable the
`ProrsaLLMClient` files the episode's trajectories and token versions under), and finishes every trajectory the
episode opened: with the loop's `reward_score` when it returns (verl's reward workers score after the loop, so a
reward computed there is not on the bus), or as `aborted` when it raises or is cancelled, then re-raises. It
also puts the per-token versions where a trainer reads them, `extra_fields["token_versions"]`, aligned with
`response_ids`: the policy version of each token the model produced, -1 on tokens it did not (tool observations,
template tokens), plus `min_global_steps` / `max_global_steps` over the whole episode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopOutput, _agent_loop_registry

from prorsa.client.surely import surely
from prorsa.trainers.verl import CURRENT_EPISODE, Episode, ProrsaLLMClient, response_versions

AGENT_LOOP_CONFIG = Path(__file__).with_name("verl_agent_loops.yaml")


class ProrsaAgentLoop:
    """An agent loop (verl's `run(sampling_params, **sample) -> AgentLoopOutput`) around the registered loop
    `agent`. Raises ValueError for an unregistered `agent`, TypeError when verl's `server_manager` is not a
    `ProrsaLLMClient` (the loop would not be rolling out on Prorsa)."""

    def __init__(self, agent: str = "single_turn_agent", name: str = "", **loop_kwargs: Any) -> None:
        if agent not in _agent_loop_registry:
            raise ValueError(
                f"ProrsaAgentLoop {name or ''}: agent {agent!r} is not a registered verl agent loop "
                f"(registered: {sorted(_agent_loop_registry)})"
            )
        client = loop_kwargs.get("server_manager")
        if not isinstance(client, ProrsaLLMClient):
            raise TypeError(
                f"ProrsaAgentLoop needs verl's llm_client to be a ProrsaLLMClient, got {type(client).__name__}: "
                "pass AgentLoopManager(config, llm_client=ProrsaLLMClient.from_config(config))"
            )
        self.agent = agent
        self.client = client
        self.inner = hydra.utils.instantiate(_agent_loop_registry[agent], **loop_kwargs)

    async def run(self, sampling_params: dict[str, Any], **sample: Any) -> AgentLoopOutput:
        episode = Episode()
        token = CURRENT_EPISODE.set(episode)
        try:
            output = await self.inner.run(sampling_params, **sample)
        except BaseException:
            # Waited for through every cancellation (prorsa.client.surely): a cancelled loop still reports its
            # trajectories before its error goes up, so none waits for the tracker's timeout.
            await surely(self.client.finish_episode(episode, status="aborted"))
            raise
        finally:
            CURRENT_EPISODE.reset(token)
        versions = episode.token_versions
        output.extra_fields["token_versions"] = response_versions(output.response_mask, versions, self.agent)
        if versions:
            output.extra_fields["min_global_steps"] = min(versions)
            output.extra_fields["max_global_steps"] = max(versions)
        await self.client.finish_episode(episode, reward=output.reward_score)
        return output


class ProrsaAgentLoopManager(AgentLoopManager):
    """verl's `AgentLoopManager`, handed Prorsa's client whatever client it is given.

    verl's own trainer (`RayPPOTrainer`) builds the manager's `llm_client` from its `LLMServerManager`, a client of
    verl-launched servers, which a Prorsa replica does not launch. Naming this class in
    `actor_rollout_ref.rollout.agent.agent_loop_manager_class` swaps in `ProrsaLLMClient.from_config(config)`;
    everything else is verl's."""

    def __init__(
        self,
        config: Any,
        llm_client: Any = None,
        teacher_client: Any = None,
        reward_loop_worker_handles: Any = None,
    ) -> None:
        if not isinstance(llm_client, ProrsaLLMClient):
            llm_client = ProrsaLLMClient.from_config(config)
        super().__init__(config, llm_client, teacher_client, reward_loop_worker_handles)

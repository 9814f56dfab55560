"""The environment of the verl test, as a verl user writes one: a tool, a tool parser and an agent loop, found by
verl's own loaders inside each AgentLoopWorker Ray actor (the tool through `multi_turn.tool_config_path`, whose
import of this module registers the parser; the loops through `agent.agent_loop_config_path`).

- `StepTool`: a BaseTool whose every call answers an observation of 40 words, reward 0.5.
- The `prorsa_test_env` tool parser: the simulated engines' output is noise, so it reads every response as a call
  of `step` (everything after the parse is verl's `ToolAgentLoop`).
- `FailingAgentLoop`: one model turn, then it raises, as a loop with a bug does: the test checks that the Prorsa
  trajectory it opened is still finished (aborted).
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

OBSERVATION_WORDS = 40
STEP_REWARD = 0.5


@ToolParser.register("prorsa_test_env")
class EveryResponseCallsStep(ToolParser):
    async def extract_tool_calls(self, responses_ids: list[int], tools: Any = None) -> tuple[str, list]:
        return self.tokenizer.decode(responses_ids), [FunctionCall(name="step", arguments="{}")]


class StepTool(BaseTool):
    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        return instance_id or uuid4().hex, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        words = " ".join(f"t{1000 + i}" for i in range(OBSERVATION_WORDS))
        return ToolResponse(text=words), STEP_REWARD, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


class AgentBug(RuntimeError):
    """What FailingAgentLoop raises."""


class FailingAgentLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        prompt = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        await self.server_manager.generate(
            request_id=uuid4().hex, prompt_ids=prompt, sampling_params=sampling_params
        )
        raise AgentBug("the environment crashed after the first turn")

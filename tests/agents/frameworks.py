"""The agent frameworks trained unchanged through the chat proxy, in one place: each an example
agent under examples/agents/, written as that framework's users write it, and what its episodes
look like on the tool model (``framework_model_dir``). Adding a framework: one line here, and, where
its first request renders differently from those below (a system prompt of its own, other tools),
its conversation in ``conftest.sequences`` so that the tool model knows it.

``FrameworkAgent`` is a test-only agent for ``recipes.chat_agent_grpo``: it plays each row with
the unchanged example agent its ``data_source`` column names, so one recipe run trains on
episodes of every framework (one run per framework would cost a recipe start each).
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import NamedTuple

from rlcore.agentic.chat_agent import load_agent

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"


class Framework(NamedTuple):  # not a dataclass: agent.path loads this file outside sys.modules
    agent: str  # examples/agents/<file>:<Class>
    segments: int  # per episode, on the tool model: 1 where every request extends the session
    tool_text: str  # the tool's result as the model sees it (the template's rendering of the result message)
    first_prompt: str  # the first request's rendering on the tiny models' template
    most_segments: int = 1  # per sampled episode, whatever the policy samples: 1 where every request extends the
    # session; where each request is a segment of its own, the most requests the example agent makes


    @property
    def path(self) -> str:
        file, _, cls = self.agent.partition(":")
        return f"{EXAMPLES / file}:{cls}"


NATIVE = "tools: calc(expression)\nuser: 2+3=\nassistant: "
FRAMEWORKS = {
    "langgraph": Framework("langgraph_agent.py:LangGraphAgent", 1, "\ntool: 5\nassistant: ", NATIVE),
    "pydantic_ai": Framework("pydantic_ai_chat.py:PydanticAIAgent", 1, "\ntool: 5\nassistant: ", NATIVE),
    # the Responses API (POST /v1/responses): the Agents SDK's default model, pydantic-ai's Responses model
    "openai_agents": Framework("openai_agents_sdk.py:AgentsSDKCalculator", 1, "\ntool: 5\nassistant: ", NATIVE),
    "pydantic_ai_responses": Framework("pydantic_ai_responses.py:PydanticAICalculator", 1, "\ntool: 5\nassistant: ",
                                       NATIVE),
    # tool calls re-sent as text, results as a user "Observation:" message: a segment per step
    "smolagents": Framework("smolagents_agent.py:SmolAgent", 2, "user: <unk>bservation:\n5\nassistant: ",
                            "tools: calc(expression), final_answer(answer)\nsystem: use the tools; answer with "
                            "final_answer.\nuser: <unk>ew task:\n2+3=\nassistant: ",
                            4),  # SmolAgent's max_steps=3 requests, then smolagents' one final-answer request
}


class FrameworkAgent:
    """Plays a row with the example agent of the framework its ``data_source`` names.

    Every framework's example is imported when the first episode's agent is made, before any episode
    runs: imported one per episode instead, a framework's first import (langgraph's of the legacy
    ``httpx``) could run while another episode's thread sends a request with the openai client, which
    reads ``sys.modules["httpx"]`` and failed on the half-imported module ("partially initialized module
    'httpx' has no attribute 'Timeout'")."""

    classes: dict[str, type] = {}

    def __init__(self) -> None:
        if not FrameworkAgent.classes:
            FrameworkAgent.classes.update({name: load_agent(f.path) for name, f in FRAMEWORKS.items()})

    async def run(self, ctx) -> float:
        agent = self.classes[ctx.task["data_source"]]()
        if inspect.iscoroutinefunction(agent.run):
            return await agent.run(ctx)
        return await asyncio.to_thread(agent.run, ctx)  # a synchronous framework (smolagents)

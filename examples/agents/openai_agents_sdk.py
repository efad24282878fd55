"""A calculator agent written with the OpenAI Agents SDK, as its users write one: an ``Agent`` with a
``@function_tool``, played by ``Runner.run`` on the SDK's default model, the Responses API.

Only where its client points comes from rlcore (``ctx.base_url``, ``ctx.api_key``,
``ctx.model_name``): the SDK posts to ``/v1/responses``, the per-session proxy serves it
(``rlcore.agentic.responses_route``), and the SDK's own loop runs the tool the model calls and sends
its output back (a ``function_call_output`` item). Tracing is off: it would upload spans to OpenAI.

The tool evaluates ``a+b`` / ``a-b`` / ``a*b`` with a regular expression, never ``eval``: the
arguments are model output.
"""

from __future__ import annotations

import re

import openai
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

set_tracing_disabled(True)  # no network: spans would go to OpenAI's tracing service


@function_tool
def calc(expression: str) -> str:
    """The value of an arithmetic expression a+b, a-b or a*b."""
    match = re.fullmatch(r"\s*(-?\d{1,6})\s*([+*-])\s*(-?\d{1,6})\s*", expression)
    if not match:
        return "error: expected a+b, a-b or a*b"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


class AgentsSDKCalculator:
    def __init__(self, max_turns: int = 4) -> None:
        self.max_turns = max_turns

    async def run(self, ctx) -> float:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                                    http_client=ctx.http_client)
        agent = Agent(name="calculator", tools=[calc],
                      model=OpenAIResponsesModel(model=ctx.model_name, openai_client=client))
        try:
            result = await Runner.run(agent, list(ctx.messages), max_turns=self.max_turns)
        except (MaxTurnsExceeded, ModelBehaviorError):  # out of turns, or a reply cut at its token cap
            return 0.0
        return float(str(result.final_output).strip() == str(ctx.label).strip())

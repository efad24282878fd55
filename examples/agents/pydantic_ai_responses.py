"""A calculator agent written with pydantic-ai on OpenAI's Responses API, as its users write one: a
module-level ``Agent`` with a plain tool, run on an ``OpenAIResponsesModel``.

Only where the model lives comes from rlcore (``ctx.base_url``, ``ctx.api_key``,
``ctx.model_name``, through ``OpenAIProvider``): pydantic-ai posts to ``/v1/responses``, the
per-session proxy serves it (``rlcore.agentic.responses_route``), and pydantic-ai's own loop runs
the tool the model calls and sends its result back (a ``function_call_output`` item).

The tool evaluates ``a+b`` / ``a-b`` / ``a*b`` with a regular expression, never ``eval``: the
arguments are model output.
"""

from __future__ import annotations

import re

from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

agent = Agent(output_type=str)


@agent.tool_plain
def calc(expression: str) -> str:
    """The value of an arithmetic expression a+b, a-b or a*b."""
    match = re.fullmatch(r"\s*(-?\d{1,6})\s*([+*-])\s*(-?\d{1,6})\s*", expression)
    if not match:
        return "error: expected a+b, a-b or a*b"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


class PydanticAICalculator:
    async def run(self, ctx) -> float:
        provider = OpenAIProvider(base_url=ctx.base_url, api_key=ctx.api_key)
        result = await agent.run(ctx.prompt, model=OpenAIResponsesModel(ctx.model_name, provider=provider))
        return float(result.output.strip() == str(ctx.label).strip())

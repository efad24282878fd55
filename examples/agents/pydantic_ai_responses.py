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
from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

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
    def __init__(self, max_requests: int = 3) -> None:
        self.max_requests = max_requests

    async def run(self, ctx) -> float:
        provider = OpenAIProvider(base_url=ctx.base_url, api_key=ctx.api_key)
        try:
            result = await agent.run(ctx.prompt, model=OpenAIResponsesModel(ctx.model_name, provider=provider),
                                     usage_limits=UsageLimits(request_limit=self.max_requests))
        except (UsageLimitExceeded, UnexpectedModelBehavior):  # out of requests, or a reply it could not use
            return 0.0
        return float(result.output.strip() == str(ctx.label).strip())

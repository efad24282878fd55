"""A pydantic-ai agent, written as pydantic-ai's users write one: an ``Agent`` over
``OpenAIChatModel`` (Chat Completions) with an ``OpenAIProvider``, and a ``calc`` tool. Only where
the provider points comes from rlcore (``ctx.base_url``, ``ctx.api_key``, ``ctx.model_name``)::

    python -m recipes.chat_agent_grpo agent.path=examples/agents/pydantic_ai_chat.py:PydanticAIAgent

pydantic-ai sends tool calls back as structured ``tool_calls`` and results as ``tool`` messages,
so each request extends the session (one segment, one try per episode). Its instrumentation
(Logfire / OpenTelemetry) is off unless ``Agent(instrument=True)`` or ``Agent.instrument_all()``.
"""

from __future__ import annotations

import re

from pydantic_ai import Agent
from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits


def calc(expression: str) -> str:
    """The value of an arithmetic expression a+b, a-b or a*b."""
    match = re.fullmatch(r"\s*(-?\d{1,6})\s*([+*-])\s*(-?\d{1,6})\s*", str(expression))
    if not match:
        return "error: expected a+b, a-b or a*b"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


class PydanticAIAgent:
    def __init__(self, max_requests: int = 3) -> None:
        self.max_requests = max_requests

    async def run(self, ctx) -> float:
        provider = OpenAIProvider(base_url=ctx.base_url, api_key=ctx.api_key)
        agent = Agent(OpenAIChatModel(ctx.model_name, provider=provider), tools=[calc], retries=0)
        try:
            result = await agent.run(ctx.prompt, usage_limits=UsageLimits(request_limit=self.max_requests))
        except (UsageLimitExceeded, UnexpectedModelBehavior):  # out of requests, or a reply it could not use
            return 0.0
        return float(result.output.strip() == str(ctx.label).strip())

"""A smolagents agent, written as smolagents' users write one: a ``ToolCallingAgent`` over
``OpenAIServerModel`` with a ``calc`` tool, a short system prompt of its own (the default one is
~5,000 tokens, more than the tiny models' context) and few steps. Only where the model points
comes from rlcore (``ctx.base_url``, ``ctx.api_key``, ``ctx.model_name``). ``run`` is a plain
``def`` (smolagents is synchronous): the runner plays it in a thread::

    python -m recipes.chat_agent_grpo agent.path=examples/agents/smolagents_agent.py:SmolAgent

smolagents sends its history back as text: the model's tool calls as an assistant message
"Calling tools: [...]", their results as a user message "Observation: ...". That cannot be
matched to the tokens the model sampled, so every step is a segment of its own (each the full
rendering of what smolagents sent); the proxy recognises the results by the call ids in that
text, so they open no new try (docs/agentic.md, "Agent frameworks"). smolagents sends no
telemetry; its console log is off here (``verbosity_level=LogLevel.OFF``).
"""

from __future__ import annotations

import re

import openai
from smolagents import LogLevel, OpenAIServerModel, ToolCallingAgent, tool
from smolagents.agents import EMPTY_PROMPT_TEMPLATES
from smolagents.utils import AgentGenerationError

SYSTEM_PROMPT = "use the tools; answer with final_answer."


@tool
def calc(expression: str) -> str:
    """The value of an arithmetic expression.

    Args:
        expression: a+b, a-b or a*b
    """
    match = re.fullmatch(r"\s*(-?\d{1,6})\s*([+*-])\s*(-?\d{1,6})\s*", str(expression))
    if not match:
        return "error: expected a+b, a-b or a*b"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


class SmolAgent:
    def __init__(self, max_steps: int = 3) -> None:
        self.max_steps = max_steps

    def run(self, ctx) -> float:
        model = OpenAIServerModel(model_id=ctx.model_name, api_base=ctx.base_url, api_key=ctx.api_key,
                                  client_kwargs={"max_retries": 0, "timeout": 60})
        agent = ToolCallingAgent(tools=[calc], model=model, max_steps=self.max_steps,
                                 prompt_templates={**EMPTY_PROMPT_TEMPLATES, "system_prompt": SYSTEM_PROMPT},
                                 verbosity_level=LogLevel.OFF)
        try:
            answer = agent.run(ctx.prompt)
        except AgentGenerationError as exc:
            cause = exc.__cause__
            if isinstance(cause, openai.BadRequestError) and cause.code == "context_length_exceeded":
                return 0.0  # its history outgrew the context: no answer
            raise
        return float(str(answer).strip() == str(ctx.label).strip())

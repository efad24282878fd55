"""A LangGraph ReAct agent, written as LangGraph's users write one: ``create_react_agent`` over
``langchain_openai.ChatOpenAI`` with a ``calc`` tool. Only where the client points comes from
rlcore (``ctx.base_url``, ``ctx.api_key``, ``ctx.model_name``)::

    python -m recipes.chat_agent_grpo agent.path=examples/agents/langgraph_agent.py:LangGraphAgent

LangGraph sends tool calls back as structured ``tool_calls`` and results as ``tool`` messages, so
each request extends the session (one segment, one try per episode). LangSmith tracing is off
unless the environment turns it on (``LANGSMITH_TRACING``); nothing here does.
"""

from __future__ import annotations

import re

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent


@tool
def calc(expression: str) -> str:
    """The value of an arithmetic expression a+b, a-b or a*b."""
    match = re.fullmatch(r"\s*(-?\d{1,6})\s*([+*-])\s*(-?\d{1,6})\s*", str(expression))
    if not match:
        return "error: expected a+b, a-b or a*b"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


class LangGraphAgent:
    def __init__(self, recursion_limit: int = 6) -> None:
        self.recursion_limit = recursion_limit  # graph steps: each model call and each tool run is one

    async def run(self, ctx) -> float:
        model = ChatOpenAI(model=ctx.model_name, base_url=ctx.base_url, api_key=ctx.api_key,
                           max_retries=0, timeout=60)
        agent = create_react_agent(model, [calc])
        try:
            state = await agent.ainvoke({"messages": [("user", ctx.prompt)]},
                                        {"recursion_limit": self.recursion_limit})
        except Exception as exc:  # the graph ran out of steps: the model never stopped calling tools
            if type(exc).__name__ == "GraphRecursionError":
                return 0.0
            raise
        answer = state["messages"][-1].content
        return float(isinstance(answer, str) and answer.strip() == str(ctx.label).strip())

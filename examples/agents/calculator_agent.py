"""An agent that may use a tool: it offers the model a ``calc`` function through ``tools=``, runs
the calls the model makes (``message.tool_calls``), sends their results back as ``tool``
messages, and takes the first reply without calls as the answer.

The tool evaluates ``a+b`` / ``a-b`` / ``a*b`` with a regular expression, never ``eval``: the
arguments are model output.
"""

from __future__ import annotations

import json
import re

import openai

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "the value of an arithmetic expression a+b, a-b or a*b",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}


def calc(expression: str) -> str:
    match = re.fullmatch(r"\s*(-?\d{1,6})\s*([+*-])\s*(-?\d{1,6})\s*", str(expression))
    if not match:
        return "error: expected a+b, a-b or a*b"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


class CalculatorAgent:
    def __init__(self, max_turns: int = 3) -> None:
        self.max_turns = max_turns
        self.tool_calls = 0

    async def run(self, ctx) -> float:
        # http_client: the runner's connection pool (optional; without it the client builds its own)
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=60,
                                    http_client=ctx.http_client)
        messages = list(ctx.messages)
        try:
            for _ in range(self.max_turns):
                reply = await client.chat.completions.create(model=ctx.model_name, messages=messages, tools=[CALC])
                message = reply.choices[0].message
                if not message.tool_calls:
                    return float((message.content or "").strip() == str(ctx.label).strip())
                messages.append(message.model_dump(exclude_none=True))
                for call in message.tool_calls:
                    self.tool_calls += 1
                    try:
                        args = json.loads(call.function.arguments)
                    except json.JSONDecodeError:
                        args = {}
                    result = calc(args.get("expression", "")) if call.function.name == "calc" else "error: no such tool"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            return 0.0
        finally:
            if ctx.http_client is None:
                await client.close()

"""An agent built on the Claude Agent SDK (``claude-agent-sdk``, which drives the Claude Code CLI),
pointed at the session's Anthropic endpoint, with one tool, ``calc``, served to the CLI over MCP by an
in-process SDK server. Nothing in it knows about training.

``python -m recipes.chat_agent_grpo agent.path=examples/agents/claude_agent_sdk.py:ClaudeSDKAgent
agent.max_total_tokens=400 rollout.max_new_tokens=120`` trains the policy behind ``ctx.session_url`` on
its episodes: the CLI asks the model (``POST /v1/messages?beta=true``, streamed), runs the ``calc``
calls the model makes and sends their results back, until the model answers without a call; the
reward is 1.0 when that answer is the label, else 0.0. The sizes are the tiny character-level models':
the CLI's prompt is ~130 tokens before the question (its tool list and a line of system prompt), a
call ``<tool_call>{"name": "mcp__arith__calc", ...}</tool_call>`` 82, so the recipe's defaults (128
tokens a session, 8 a reply) leave no room for one. (The default warm start never calls tools: the
tests teach a tiny model to.)

Each episode runs the CLI with only what the session gives it (docs/agentic.md, "Claude Agent SDK"):
the endpoint and the session's key (``ANTHROPIC_API_KEY``, and ``ANTHROPIC_AUTH_TOKEN`` too, so that a
token in the machine's environment is never sent), a throwaway ``HOME`` / ``CLAUDE_CONFIG_DIR`` /
working directory (nothing of the machine's user: settings, CLAUDE.md, memory, sessions), ``--bare``
(no hooks, plugins, CLAUDE.md discovery, background prefetches; no environment-context message with
the date and the working directory, so the same task gives the same prompt), no telemetry or
non-essential traffic, no attribution header in the system prompt, thinking off (the policy does not
think in Anthropic's format), no built-in tools, the output cap the run's per-reply tokens.

The tool evaluates ``a+b`` / ``a-b`` / ``a*b`` with a regular expression, never ``eval``: its input is
model output.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from typing import Any

from claude_agent_sdk import ClaudeAgentOptions, ResultError, ResultMessage, create_sdk_mcp_server, query, tool

SERVER = "arith"  # the CLI names the tool mcp__<server>__<tool>
TOOL = f"mcp__{SERVER}__calc"


def calc(expression: str) -> str:
    match = re.fullmatch(r"\s*(-?\d{1,6})\s*([+*-])\s*(-?\d{1,6})\s*", str(expression))
    if not match:
        return "error: expected a+b, a-b or a*b"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


def cli_env(ctx, home: str) -> dict[str, str]:
    """The CLI's environment on top of the runner's: the session's endpoint and key, a throwaway home."""
    return {
        "ANTHROPIC_BASE_URL": ctx.session_url, "ANTHROPIC_API_KEY": ctx.api_key, "ANTHROPIC_AUTH_TOKEN": ctx.api_key,
        "HOME": home, "CLAUDE_CONFIG_DIR": f"{home}/.claude",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",  # else a billing line with the CLI's version opens the system prompt
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(ctx.sampling["max_tokens"]),
        "CLAUDE_CODE_USE_BEDROCK": "0", "CLAUDE_CODE_USE_VERTEX": "0", "CLAUDE_CODE_USE_FOUNDRY": "0",  # the
        # machine's choice of provider, off
    }


class ClaudeSDKAgent:
    def __init__(self, max_turns: int = 3) -> None:
        self.max_turns = max_turns
        self.tool_calls: list[dict[str, Any]] = []  # the calc calls the CLI ran, with their inputs
        self.result: ResultMessage | None = None

    async def run(self, ctx) -> float:
        @tool("calc", "the value of an arithmetic expression a+b, a-b or a*b", {"expression": str})
        async def calc_tool(args: dict[str, Any]) -> dict[str, Any]:
            self.tool_calls.append(dict(args))
            return {"content": [{"type": "text", "text": calc(args.get("expression", ""))}]}

        home = tempfile.mkdtemp(prefix="rlcore-claude-")
        options = ClaudeAgentOptions(
            model=ctx.model_name, max_turns=self.max_turns, cwd=home, env=cli_env(ctx, home),
            mcp_servers={SERVER: create_sdk_mcp_server(SERVER, tools=[calc_tool])},
            tools=[], allowed_tools=[TOOL], setting_sources=[], thinking={"type": "disabled"},
            extra_args={"bare": None})
        try:  # aclosing: an episode cancelled (its timeout) closes the SDK's stream, which ends the CLI
            async with contextlib.aclosing(query(prompt=ctx.prompt, options=options)) as messages:
                async for message in messages:
                    if isinstance(message, ResultMessage):
                        self.result = message
        except ResultError as exc:  # the CLI reported a failed run, then exited non-zero
            if exc.subtype == "error_max_turns" or "prompt is too long" in (exc.result or "").lower():
                return 0.0  # out of turns, or no room left in the session's context: no answer
            raise
        finally:
            shutil.rmtree(home, ignore_errors=True)
        answer = (self.result.result or "") if self.result is not None else ""
        return float(answer.strip() == str(ctx.label).strip())

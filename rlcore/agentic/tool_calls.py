"""Tool calls in the model's text, as OpenAI's structured ``tool_calls``.

Why parse here: an agent written against the OpenAI client reads ``message.tool_calls`` and
answers with ``{"role": "tool", "tool_call_id": ..., "content": ...}``; it never parses the
model's raw text. So the proxy turns the chat template's tool-call convention into that
structure, and the template renders the tool results of the next request back into the
model's format (``rlcore.models.tiny.CHAT_TEMPLATE``, Qwen's and Hermes' templates alike).

The convention: ``<tool_call>{"name": <str>, "arguments": <object>}</tool_call>``, any number of
them, anywhere in the reply; the text outside them is the message's ``content``. A block whose
JSON does not parse, or lacks a string ``name``, is not a call: it stays in ``content`` (the agent
sees what the model wrote, and the finish reason stays ``stop``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire format)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a reply: the text outside well-formed call blocks (None when only
    whitespace is left and there are calls), and the calls in order."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in TOOL_CALL.finditer(text):
        call = _parse_one(match.group(1))
        if call is None:
            continue  # not a call: stays in the content
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept)
    if calls and not content.strip():
        return None, calls
    return (content.strip() if calls else content), calls


def _parse_one(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(arguments, ensure_ascii=False))


def canonical_arguments(arguments: Any) -> Any:
    """Arguments as a comparable value (a JSON text and the object it encodes compare equal)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments

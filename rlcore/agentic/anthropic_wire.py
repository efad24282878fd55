"""Anthropic's Messages wire format (``POST /v1/messages``): the request decoded into the canonical one,
the reply and its event stream encoded back.

Why: agents written with the stock ``anthropic`` client (``anthropic.AsyncAnthropic(base_url=
ctx.session_url, api_key=ctx.api_key)``) should train as they are, exactly as OpenAI-client
agents do. Rather than a second proxy, a Messages request is translated into the canonical
OpenAI-shaped request (``openai_wire.ChatRequest``), so both wires share one session, one
rendering and one generation path (``chat_turn``), and give the same ids for the same conversation:

    system (a string or text blocks)       -> a leading system message
    a system message among messages        -> a system message there (the Claude Code CLI sends its
                                              environment context so)
    user text blocks                        -> a user message (the blocks' text joined)
    user tool_result blocks                 -> tool messages (tool_call_id = tool_use_id), before the text
    assistant text + tool_use blocks        -> an assistant message with tool_calls (input as arguments)
    tools [{name, description, input_schema}] -> function tools (input_schema as parameters); a tool with
                                              ``defer_loading`` is left out (Anthropic's API keeps it out
                                              of the model's context until a tool search loads it)
    tool_choice auto / any / tool / none    -> auto / required / that function / none
    stop_sequences, max_tokens, stream      -> stop, max_tokens, stream
    temperature, top_p, top_k               -> honoured only with ``client_sampling`` (as OpenAI's)

Replies: ``content`` is a text block (when the model wrote text, or wrote nothing and called no
tool) then a ``tool_use`` block per parsed call; ``stop_reason`` is ``end_turn``, ``max_tokens``,
``stop_sequence`` (with ``stop_sequence``, the string) or ``tool_use``; ``usage`` counts the real
input and output tokens. Streaming sends Anthropic's events: ``message_start``,
``content_block_start`` / ``content_block_delta`` (``text_delta``; ``input_json_delta`` with a
call's whole input) / ``content_block_stop``, ``message_delta`` (stop reason, output tokens),
``message_stop``; an error mid-stream is an ``error`` event.

Accepted and ignored, as the clients send them: ``cache_control``, ``metadata``, ``output_config.effort``
(a hint), ``context_management`` edits that clear thinking (there is none), ``thinking`` ``adaptive`` (the
model decides whether to think; the policy never writes Anthropic thinking blocks, so it does not).

Refused with a 400 naming the field, rather than silently dropped: images and documents (the
engines take text), ``thinking`` blocks and an enabled ``thinking`` (the model does not think in
Anthropic's format), other ``context_management`` edits (clearing tool results would change what the
policy sees, and nothing here does it), ``output_config`` other than ``effort`` (structured output:
the engines have no constrained decoding), server tools (``web_search``, ``bash``, ...: nothing here
runs them), a last assistant message (prefill: the reply would have to continue text the session did
not sample), and ``disable_parallel_tool_use`` (every call the model writes is returned). Errors use Anthropic's
body, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlcore.agentic.chat_session import RequestError
from rlcore.agentic.openai_wire import ChatRequest, validated

MAX_STOP_SEQUENCES = 16
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in ("messages", "max_tokens")}
        return data


def parse_messages_request(body: Any) -> ChatRequest:
    """The Messages request as the canonical chat request; a ``RequestError`` naming the first bad field."""
    req = validated(MessagesRequest, body)
    if (req.thinking or {}).get("type", "disabled") not in ("disabled", "adaptive"):
        raise RequestError("thinking is not supported: the policy does not write Anthropic thinking blocks; "
                           "leave thinking out or set it to {\"type\": \"disabled\"} (or \"adaptive\")",
                           param="thinking")
    _check_ignorable(req)
    stops = req.stop_sequences or []
    if len(stops) > MAX_STOP_SEQUENCES or not all(stops):
        raise RequestError(f"stop_sequences must be up to {MAX_STOP_SEQUENCES} non-empty strings",
                           param="stop_sequences")
    canonical: dict[str, Any] = {
        "model": req.model, "messages": _messages(req.system, req.messages), "max_tokens": req.max_tokens,
        "stop": stops or None, "stream": req.stream, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k}
    tools = [_tool(t, i) for i, t in enumerate(req.tools or []) if not (isinstance(t, dict) and t.get("defer_loading"))]
    if tools:
        canonical["tools"] = tools
    if req.tool_choice is not None:
        canonical["tool_choice"] = _tool_choice(req.tool_choice)
    return ChatRequest.model_validate(canonical)


def _check_ignorable(req: MessagesRequest) -> None:
    """The extras that are ignored only where ignoring them changes nothing the policy sees or writes."""
    edits = (req.context_management or {}).get("edits") or []
    for i, edit in enumerate(edits if isinstance(edits, list) else [edits]):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not (isinstance(kind, str) and kind.startswith("clear_thinking")):
            raise RequestError(f"context_management.edits[{i}]: {kind!r} is not supported: only clearing thinking "
                               "(there is none here) is; the session keeps the whole conversation",
                               param=f"context_management.edits[{i}]")
    other = sorted(set(req.output_config or {}) - {"effort"})
    if other:
        raise RequestError(f"output_config: {other} not supported (only effort, which is ignored): the engines "
                           "have no constrained decoding", param="output_config")


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise RequestError(f"{where}[{j}]: only text blocks are supported here, got {kind!r}",
                                   param=f"{where}[{j}]")
            parts.append(block["text"])
        return "".join(parts)
    raise RequestError(f"{where} must be a string or a list of text blocks", param=where)


def _messages(system: Any, messages: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": _text(system, "system")}] if system else []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            role = m.get("role") if isinstance(m, dict) else None
            raise RequestError(f"{where}.role must be 'user', 'assistant' or 'system', got {role!r}",
                               param=f"{where}.role")
        if m["role"] == "system":
            out.append({"role": "system", "content": _text(m.get("content", ""), f"{where}.content")})
            continue
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise RequestError(f"{where}.content must be a string or a list of content blocks",
                               param=f"{where}.content")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise RequestError(f"{at}: a tool_use block needs a name and an input object", param=at)
                calls.append({"id": str(block.get("id", "")), "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and m["role"] == "user":
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _text(block.get("content", ""), f"{at}.content")})
            else:
                raise RequestError(f"{at}: a {kind!r} block is not supported in a {m['role']} message (text, "
                                   "tool_use in assistant messages and tool_result in user messages are)", param=at)
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
        elif texts or not blocks:
            out.append({"role": "user", "content": "".join(texts)})
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        raise RequestError("a last assistant message (prefill) is not supported: the reply would continue text "
                           "the policy did not sample; end messages with a user message",
                           param=f"messages[{len(messages) - 1}]")
    return out


def _tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise RequestError(f"{where}: server tools ({kind!r}) are not supported: nothing here runs them; "
                           "give client tools with name, description and input_schema", param=where)
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise RequestError(f"{where} needs a name and an input_schema object", param=where)
    fn = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description"):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any]) -> Any:
    if choice.get("disable_parallel_tool_use"):
        raise RequestError("tool_choice.disable_parallel_tool_use is not supported: the model may write several "
                           "calls in one reply, and every one is returned", param="tool_choice.disable_parallel_tool_use")
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(f"tool_choice must be {{\"type\": \"auto\" | \"any\" | \"none\"}} or "
                       f"{{\"type\": \"tool\", \"name\": ...}}, got {json.dumps(choice)}", param="tool_choice")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The reply's content blocks: its text (also when empty, unless it called tools), then its calls."""
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    blocks = [{"type": "text", "text": text}] if text or not calls else []
    return blocks + [_tool_use(call) for call in calls]


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def _stop(choice: Any) -> tuple[str, str | None]:
    if choice.stop_sequence is not None:
        return "stop_sequence", choice.stop_sequence
    return STOP_REASONS[choice.finish], None


def message_response(mid: str, model: str, prompt_tokens: int, choice: Any) -> dict[str, Any]:
    """The Messages API reply of one ``chat_turn.Choice``."""
    reason, sequence = _stop(choice)
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(choice.reply.message), "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(choice.reply.completion.token_ids)}}


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class AnthropicStream:
    """A streamed Messages reply (one choice): the events the ``anthropic`` client's stream reads."""

    def __init__(self, mid: str, model: str, prompt_tokens: int) -> None:
        self.mid, self.model, self.prompt_tokens = mid, model, prompt_tokens
        self.block = -1  # the index of the last block started
        self.text_open = False

    def start(self) -> list[str]:
        message = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return [event("message_start", {"message": message})]

    def text(self, index: int, text: str, logprobs: list[dict]) -> list[str]:
        events = []
        if not self.text_open:
            self.block, self.text_open = self.block + 1, True
            events.append(event("content_block_start", {"index": self.block,
                                                        "content_block": {"type": "text", "text": ""}}))
        return events + [event("content_block_delta", {"index": self.block,
                                                       "delta": {"type": "text_delta", "text": text}})]

    def finish(self, index: int, rest: str, logprobs: list[dict], choice: Any) -> list[str]:
        calls = choice.reply.message.get("tool_calls") or []
        events = self.text(index, rest, logprobs) if rest or (not calls and not self.text_open) else []
        if self.text_open:
            events.append(event("content_block_stop", {"index": self.block}))
            self.text_open = False
        for block in content_blocks(choice.reply.message)[-len(calls):] if calls else []:
            self.block += 1
            events += [event("content_block_start", {"index": self.block, "content_block": {**block, "input": {}}}),
                       event("content_block_delta", {"index": self.block, "delta": {
                           "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}),
                       event("content_block_stop", {"index": self.block})]
        reason, sequence = _stop(choice)
        return events + [event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                 "usage": {"output_tokens": len(choice.reply.completion.token_ids)}})]

    def end(self, prompt_tokens: int, choices: list[Any]) -> list[str]:
        return [event("message_stop", {})]

    def error(self, message: str, kind: str, code: str) -> list[str]:
        return [event("error", {"error": {"type": "timeout_error" if code == "timeout" else "api_error",
                                          "message": message}})]

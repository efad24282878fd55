"""OpenAI's Responses wire format (``POST /v1/responses``): the request decoded into the canonical one,
the ``Response`` object encoded back.

Why: the OpenAI Agents SDK's default model and pydantic-ai's ``OpenAIResponsesModel`` speak the
Responses API, not chat completions. As with Anthropic's wire (``anthropic_wire``), a Responses
request is translated into the canonical OpenAI-chat request (``openai_wire.ChatRequest``), so it
shares the session, the rendering and the generation path (``chat_turn``) and gives the same ids
as the chat route for the same conversation:

    instructions                               -> a leading system message (this request's only:
                                                  an earlier response's are not carried over)
    input: a string                             -> a user message
    message items (role user / system / developer / assistant; content a string or input_text /
    output_text parts)                          -> messages (developer as system)
    function_call items (call_id, name, arguments) -> the tool_calls of an assistant message (merged
                                                  with the assistant message item just before them)
    function_call_output items (call_id, output) -> tool messages (tool_call_id = call_id)
    tools [{"type": "function", name, parameters}] -> function tools
    tool_choice auto / none / required / {"type": "function", "name"} -> the same
    max_output_tokens, temperature, top_p, stream -> max_tokens, temperature, top_p, stream
    include ["message.output_text.logprobs"], top_logprobs -> logprobs, top_logprobs

``previous_response_id`` continues a response of the same session: the session keeps each
response's conversation (its input, after the previous one's, then its output), and the request's
items follow it. Replies are ``Response`` objects: ``output`` holds a ``message`` item with one
``output_text`` part (when the model wrote text, or wrote nothing and called no tool), then a
``function_call`` item per parsed call; ``status`` is ``completed``, or ``incomplete`` with
``incomplete_details.reason = "max_output_tokens"``; ``usage`` counts the real tokens.

Refused with a 400 naming the item or field, rather than silently dropped: item types other than
the three above (``reasoning``, ``item_reference``, hosted tools' calls: the policy writes none),
non-text content (images, files, audio), a ``function_call`` whose output is missing and an output
whose call is missing (both named by ``call_id``), hosted tools (``web_search``, ``file_search``,
...: nothing here runs them), ``text.format`` other than text (no constrained decoding), ``background``,
``conversation`` and ``prompt`` (not served), ``parallel_tool_calls: false`` (as on the chat route:
every call the model writes is returned), and an unknown ``previous_response_id``. ``store``,
``truncation``, ``reasoning`` (the policy writes no reasoning items), ``metadata`` and other fields
are accepted.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlcore.agentic.chat_session import RequestError
from rlcore.agentic.openai_wire import ChatRequest, validated
from rlcore.engines.base import SamplingSettings

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=SamplingSettings.MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    parallel_tool_calls: bool = True
    store: bool = True
    stream: bool = False
    text: dict[str, Any] | None = None
    background: bool = False
    conversation: Any = None
    prompt: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @property
    def logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or [])


def parse_responses_request(body: Any) -> ResponsesRequest:
    """The request, validated, with what it refuses named; its items are decoded by ``chat_request``."""
    req = validated(ResponsesRequest, body)
    for name in ("background", "conversation", "prompt"):
        if getattr(req, name):
            raise RequestError(f"{name} is not supported by this endpoint (each request is answered at once, from "
                               "its own input and previous_response_id)", param=name)
    fmt = (req.text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if kind != "text":
        raise RequestError(f"text.format {kind!r} is not supported: the engines have no constrained "
                           "decoding; leave text.format out or use {\"type\": \"text\"}", param="text.format")
    return req


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """The canonical request, and the conversation a response to it continues (``history``, the
    previous response's, then this request's input: without the instructions, which are not carried over)."""
    conversation = history + input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    if not messages:
        raise RequestError("input is empty: give a string or at least one item", param="input")
    _check_calls_answered(conversation)
    canonical: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens, "stream": req.stream,
        "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
        "logprobs": req.logprobs, "top_logprobs": req.top_logprobs if req.logprobs else None}
    if req.tools:
        canonical["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        canonical["tool_choice"] = _tool_choice(req.tool_choice)
    return ChatRequest.model_validate({k: v for k, v in canonical.items() if v is not None}), conversation


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """The input items as chat messages: function calls join the assistant message before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object, got {type(item).__name__}", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise RequestError(f"{where}.role must be one of {sorted(ROLES)}, got {item.get('role')!r}",
                                   param=f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise RequestError(f"{where}: a function_call item needs call_id, name and arguments strings",
                                   param=where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}: a function_call_output item needs a call_id string", param=where)
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output", ""), f"{where}.output")})
        else:
            raise RequestError(f"{where}: item type {kind!r} is not supported (message, function_call and "
                               "function_call_output items are)", param=where)
    return out


def _text(content: Any, where: str) -> str:
    """A string, or text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}[{j}]: only text parts ({', '.join(TEXT_PARTS[:2])}) are supported, "
                                   f"got {kind!r}", param=f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where} must be a string or a list of text parts", param=where)


def _check_calls_answered(messages: list[dict[str, Any]]) -> None:
    """Every function call has its output after it, and every output a call before it."""
    open_calls: dict[str, None] = {}
    for m in messages:
        for call in m.get("tool_calls", []):
            open_calls[call["id"]] = None
        if m["role"] == "tool":
            if m["tool_call_id"] not in open_calls:
                raise RequestError(f"no function_call with call_id {m['tool_call_id']!r} before its "
                                   "function_call_output", param="input")
            del open_calls[m["tool_call_id"]]
    if open_calls:
        raise RequestError(f"no function_call_output for the function_call with call_id {next(iter(open_calls))!r}: "
                           "send each call's output (type function_call_output, the same call_id)", param="input")


def _tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
    if kind != "function":
        raise RequestError(f"{where}: tools of type {kind!r} are not supported: nothing here runs hosted tools; "
                           "give function tools ({\"type\": \"function\", \"name\", \"parameters\"})", param=where)
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise RequestError(f"{where} needs a name", param=where)
    fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(f"tool_choice must be 'auto', 'none', 'required' or {{\"type\": \"function\", \"name\": ...}}, "
                       f"got {json.dumps(choice)}", param="tool_choice")


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, choice: Any) -> dict[str, Any]:
    output = len(choice.reply.completion.token_ids)
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt_tokens + output}


def message_item(mid: str, text: str, status: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [text_part(text, logprobs)] if status != "in_progress" else []}


def text_part(text: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"] if status == "completed"
            else "", "status": status}


def output_items(choice: Any) -> list[dict[str, Any]]:
    """The reply's output items: its text as a message (also when empty, unless it called tools), then its calls."""
    calls = choice.reply.message.get("tool_calls") or []
    text = choice.reply.message.get("content") or ""
    logprobs = [e for _, e in choice.pieces if e is not None]
    message = [message_item(f"msg_{uuid.uuid4().hex}", text, _status(choice), logprobs)] if text or not calls else []
    return message + [call_item(c) for c in calls]


def _status(choice: Any) -> str:
    return "incomplete" if choice.finish == "length" else "completed"


def response_object(rid: str, model: str, req: ResponsesRequest, status: str, output: list[dict[str, Any]],
                    usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``Response``: the request's settings echoed, its output, status and usage."""
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": model, "output": output, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "store": req.store, "temperature": req.temperature,
            "top_p": req.top_p, "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {}, "usage": usage_}


def response_body(rid: str, model: str, req: ResponsesRequest, prompt_tokens: int, choice: Any) -> dict[str, Any]:
    """The non-streamed reply of one ``chat_turn.Choice``."""
    return response_object(rid, model, req, _status(choice), output_items(choice), usage(prompt_tokens, choice))

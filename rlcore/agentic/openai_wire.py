"""OpenAI's chat-completions wire format: the request we accept, the replies and stream chunks we send.

Why a module of its own: the proxy (``rlcore.agentic.chat_proxy``) is about sessions, tokens and
safety; what a stock ``openai`` client sends and expects back is a separate contract, kept here
in one place. Requests are validated with pydantic, so a malformed one is a 400 with OpenAI's
error body naming the field, never an exception inside the server.

``null`` for an optional field means "not given", as OpenAI's API takes it. ``tool_choice``:
``"auto"`` (the default with tools), ``"none"`` (the tools are not rendered into the prompt at
all), ``"required"`` and ``{"type": "function", "function": {"name": ...}}`` (the assistant turn is
started with the template's tool-call opening, and for a named function with that function's
name, so the model writes the rest; ``rlcore.agentic.chat_turn``). Knobs the engines cannot
honour (penalties, ``logit_bias``, ``parallel_tool_calls: false``) are refused with a 400 naming
the field rather than silently ignored; unknown extra fields (``user``, ``metadata``, ``seed``,
...) are accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlcore.agentic.chat_session import RequestError, Reply
from rlcore.engines.base import SamplingSettings

_Body = TypeVar("_Body", bound=BaseModel)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # checked by tool_mode(), for an error that names what is supported
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=SamplingSettings.MAX_TOP_LOGPROBS)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        """OpenAI's API reads ``"logprobs": null`` (and every optional field so) as the field left out."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k == "messages"}
        return data

    def tool_mode(self) -> tuple[str, str | None]:
        """``(mode, name)``: mode ``"none"``, ``"auto"``, ``"required"`` or ``"function"`` (name: which)."""
        choice, names = self.tool_choice, [_tool_name(t) for t in self.tools or []]
        if choice is None:
            return ("auto" if names else "none"), None
        if choice in ("auto", "none", "required"):
            mode, name = choice, None
        elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
              and isinstance(choice["function"].get("name"), str)):
            mode, name = "function", choice["function"]["name"]
        else:
            raise RequestError(f"tool_choice must be 'none', 'auto', 'required' or "
                               f'{{"type": "function", "function": {{"name": ...}}}}, got {json.dumps(choice)}',
                               param="tool_choice")
        if mode in ("required", "function") and not names:
            raise RequestError(f"tool_choice {json.dumps(choice)} needs tools: this request offers none",
                               param="tool_choice")
        if mode == "function" and name not in names:
            raise RequestError(f"tool_choice names the function {name!r}, which is not among the tools offered "
                               f"({', '.join(map(repr, names))})", param="tool_choice")
        return mode, name

    @property
    def rendered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows the model: none with ``tool_choice="none"``."""
        return self.tools if self.tools and self.tool_mode()[0] != "none" else None

    def check_supported(self, max_n: int, max_stops: int = 4) -> None:
        if self.n > max_n:
            raise RequestError(f"n={self.n} is more than this endpoint allows ({max_n})", param="n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise RequestError(f"{name} is not supported (the trainer needs the sampler's own distribution)",
                                   param=name)
        if self.logit_bias:
            raise RequestError("logit_bias is not supported", param="logit_bias")
        for i, tool in enumerate(self.tools or []):
            if not _tool_name(tool):
                raise RequestError(f"tools[{i}] needs function.name", param=f"tools[{i}]")
        self.tool_mode()
        if not self.parallel_tool_calls:
            raise RequestError("parallel_tool_calls=false is not supported: the model may write several calls in "
                               "one reply, and every one is returned", param="parallel_tool_calls")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if len(stops) > max_stops or not all(isinstance(s, str) and s for s in stops):
                raise RequestError(f"stop must be up to {max_stops} non-empty strings", param="stop")

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else ((self.stop,) if isinstance(self.stop, str) else tuple(self.stop))

    @property
    def parse_tools(self) -> bool:
        return self.rendered_tools is not None


def _tool_name(tool: Any) -> str | None:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) and name else None


def validated(model: type[_Body], body: Any) -> _Body:
    """``body`` as the wire's request ``model``; a ``RequestError`` naming the first bad field otherwise
    (every wire's parser starts here: OpenAI's chat, Responses, Anthropic's messages)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise RequestError(f"{where}: {first['msg']}", param=where or None) from None


def parse_request(body: Any) -> ChatRequest:
    """The request, validated; a ``RequestError`` naming the first bad field otherwise."""
    return validated(ChatRequest, body)


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, replies: list[Reply]) -> dict[str, int]:
    completion_tokens = sum(len(r.completion.token_ids) for r in replies)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_content(reply: Reply, token_text) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: per sampled token its text, log-prob, bytes, and the top ones."""
    c = reply.completion
    return token_logprobs(c.token_ids, c.log_probs, c.top_logprobs, token_text)


def token_logprobs(token_ids: list[int], log_probs: list[float], top: list | None, token_text) -> list[dict[str, Any]]:
    """``logprobs.content`` entries of these tokens (``top``: per token its (id, log-prob) alternatives)."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in alts]}
            for t, lp, alts in zip(token_ids, log_probs, top or [[] for _ in token_ids])]


def completion_response(rid: str, model: str, prompt_tokens: int, choices: list[Any], logprobs: bool) -> dict[str, Any]:
    """The ``chat.completion`` body of ``chat_turn.Choice`` s."""
    body = [{"index": i, "message": c.reply.message, "finish_reason": c.finish,
             "logprobs": {"content": [e for _, e in c.pieces if e is not None]} if logprobs else None}
            for i, c in enumerate(choices)]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": body, "usage": usage(prompt_tokens, [c.reply for c in choices])}


def chunk(rid: str, model: str, created: int, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of a streamed reply."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices,
            **extra}


def delta(index: int, fields: dict[str, Any], finish_reason: str | None = None,
          logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One choice's part of a chunk: its ``delta`` (role, content or tool calls), then its finish reason."""
    out: dict[str, Any] = {"index": index, "delta": fields, "finish_reason": finish_reason}
    if logprobs:
        out["logprobs"] = {"content": logprobs}
    return out


def sse(data: dict[str, Any] | str) -> str:
    """A server-sent event line pair, as OpenAI streams them."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class OpenAIStream:
    """A streamed reply as OpenAI sends it: a role chunk per choice, content deltas, each choice's tool
    calls whole and its finish reason, the usage chunk when asked (``stream_options.include_usage``),
    ``[DONE]``. Choices are ``chat_turn.Choice``."""

    def __init__(self, rid: str, model: str, req: ChatRequest) -> None:
        self.rid, self.model, self.req, self.created = rid, model, req, int(time.time())

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse(chunk(self.rid, self.model, self.created, choices, **extra))

    def start(self) -> list[str]:
        return [self._chunk([delta(i, {"role": "assistant", "content": ""})]) for i in range(self.req.n)]

    def text(self, index: int, text: str, logprobs: list[dict]) -> list[str]:
        return [self._chunk([delta(index, {"content": text}, logprobs=logprobs)])]

    def finish(self, index: int, rest: str, logprobs: list[dict], choice: Any) -> list[str]:
        events = []
        if rest or logprobs:
            events.append(self._chunk([delta(index, {"content": rest}, logprobs=logprobs)]))
        for k, call in enumerate(choice.reply.message.get("tool_calls") or []):
            events.append(self._chunk([delta(index, {"tool_calls": [{"index": k, **call}]})]))
        events.append(self._chunk([delta(index, {}, finish_reason=choice.finish)]))
        return events

    def end(self, prompt_tokens: int, choices: list[Any]) -> list[str]:
        events = []
        if self.req.stream_options and self.req.stream_options.include_usage:
            events.append(self._chunk([], usage=usage(prompt_tokens, [c.reply for c in choices])))
        return events + [sse("[DONE]")]

    def error(self, message: str, kind: str, code: str) -> list[str]:
        return [sse(error_body(message, kind, code=code))]

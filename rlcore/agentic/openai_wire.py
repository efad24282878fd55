"""OpenAI's chat-completions wire format: the request we accept, the replies and stream chunks we send.

Why a module of its own: the proxy (``rlcore.agentic.chat_proxy``) is about sessions, tokens and
safety; what a stock ``openai`` client sends and expects back is a separate contract, kept here
in one place. Requests are validated with pydantic, so a malformed one is a 400 with OpenAI's
error body naming the field, never an exception inside the server.

Sampling knobs the engines cannot honour (penalties, ``logit_bias``, a forced ``tool_choice``)
are refused with a 400 rather than silently ignored; unknown extra fields (``user``,
``metadata``, ...) are accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlcore.agentic.chat_session import RequestError, Reply
from rlcore.engines.base import SamplingSettings


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | dict[str, Any] | None = None
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

    def check_supported(self, max_n: int) -> None:
        if self.n > max_n:
            raise RequestError(f"n={self.n} is more than this endpoint allows ({max_n})", param="n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise RequestError(f"{name} is not supported (the trainer needs the sampler's own distribution)",
                                   param=name)
        if self.logit_bias:
            raise RequestError("logit_bias is not supported", param="logit_bias")
        if isinstance(self.tool_choice, dict):
            raise RequestError("tool_choice naming a function is not supported: the model chooses ('auto') "
                               "or is not offered tools ('none')", param="tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if len(stops) > 4 or not all(stops):
                raise RequestError("stop must be up to 4 non-empty strings", param="stop")

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else ((self.stop,) if isinstance(self.stop, str) else tuple(self.stop))

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def parse_request(body: Any) -> ChatRequest:
    """The request, validated; a ``RequestError`` naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise RequestError(f"{where}: {first['msg']}", param=where or None) from None


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


def completion_response(rid: str, model: str, prompt_tokens: int, replies: list[Reply], finish: list[str],
                        logprobs: list | None) -> dict[str, Any]:
    choices = [{"index": i, "message": r.message, "finish_reason": finish[i],
                "logprobs": None if logprobs is None else {"content": logprobs[i]}}
               for i, r in enumerate(replies)]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, replies)}


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

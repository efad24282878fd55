"""An OpenAI-compatible chat endpoint per session, token-exact: how a black-box agent is trained.

Why: much agent code owns its loop and talks to a model only through the OpenAI client
(``chat.completions.create``, tool calls, tool results, again). Point that client at
``ctx.base_url`` (``http://127.0.0.1:<port>/s/<session>/v1``) and every request of the episode is
served by the policy: the session in the URL path keeps all its turns on one engine (the
session-sticky router) and in one token-exact trajectory (``rlcore.agentic.chat_session``), so
the agent needs no ``extra_body`` and no change at all.

Routes (OpenAI wire format, ``rlcore.agentic.openai_wire``):
    POST /s/{session}/v1/chat/completions   non-streaming, or SSE deltas with ``stream=true``
                                            (``stream_options.include_usage``); n, max_tokens /
                                            max_completion_tokens, stop, logprobs / top_logprobs,
                                            tools -> structured ``tool_calls``; real ``usage``
    GET  /s/{session}/v1/models             the one model, ``model_name``

Sampling: by default every request samples with the run's settings (temperature, top-p, top-k):
the trainer's log-probs refer to them, whatever temperature the agent's code asks for.
``client_sampling=True`` honours the request's ``temperature`` / ``top_p`` instead (serving,
evaluation). A reply is bounded by the run's per-turn cap, the request's ``max_tokens`` and the
room left in the session's context (``max_total_tokens``).

Streaming: ``stream=true`` sends the reply's text as the engine samples it (``generate_stream``,
through the router and the engine server; ``rlcore.agentic.chat_stream``): only stable text (whole
characters, never part of a stop string or of a tool call), tool calls whole at the end. The
session records the same reply as the non-streamed path would; a client that hangs up mid-stream
cancels the request in the engine and leaves nothing recorded.

Safety: binds 127.0.0.1 on a port the kernel picks; every request carries ``Bearer <key>`` where
the key is an HMAC of the session id under a per-run secret, so one session's key opens no other
session; bodies over ``max_request_bytes`` get a 413; any error is OpenAI's error body with a 4xx
or 5xx, never a dead server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import secrets
import socket
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from rlcore.agentic.chat import ChatDelta
from rlcore.agentic.chat_session import ChatSession, Reply, RequestError
from rlcore.agentic.chat_stream import StreamedTurn
from rlcore.agentic.episode import Generator, Trajectory
from rlcore.agentic.openai_wire import (
    ChatRequest,
    completion_id,
    completion_response,
    error_body,
    logprobs_content,
    parse_request,
)
from rlcore.agentic.tool_calls import parse_tool_calls
from rlcore.engines.base import SamplingSettings


@dataclass(frozen=True)
class ChatProxyConfig:
    host: str = "127.0.0.1"  # loopback: agents run on this machine
    port: int = 0  # 0: a free port the kernel picks
    model_name: str = "policy"
    max_request_bytes: int = 1 << 20
    max_n: int = 8  # choices per request
    client_sampling: bool = False  # honour the request's temperature / top_p (not for training)
    request_timeout_s: float = 300.0  # one request's generation


@dataclass(frozen=True)
class SessionAccess:
    """What an agent needs to reach its session."""

    session_id: str
    base_url: str  # for openai.AsyncOpenAI(base_url=...)
    api_key: str


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the host process (a test, a Ray actor) owns its signals
        yield


class ChatProxy:
    def __init__(self, generator: Generator, tokenizer: Any, sampling: SamplingSettings,
                 config: ChatProxyConfig = ChatProxyConfig(), secret: bytes | None = None) -> None:
        self.generator, self.tokenizer, self.sampling, self.config = generator, tokenizer, sampling, config
        self.delta = ChatDelta(tokenizer)
        self._secret = secret or secrets.token_bytes(32)
        self.sessions: dict[str, ChatSession] = {}
        self.url: str | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self.app = self._build_app()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Serve on this event loop; returns the root URL."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: without it a streamed delta on a kept-alive connection
        # waited for the client's delayed ACK (Nagle), ~40 ms before the first token arrived.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.config.host, self.config.port))
        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30)
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        for _ in range(500):  # up within 5 s, or its error surfaces
            if self._server.started or self._task.done():
                break
            await asyncio.sleep(0.01)
        if not self._server.started:
            if self._task.done() and self._task.exception():
                raise RuntimeError(f"the chat proxy did not start: {self._task.exception()!r}")
            raise TimeoutError("the chat proxy did not start within 5 s")
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._task, timeout=10)
            self._server = None

    # ------------------------------------------------------------------ sessions
    def api_key(self, session_id: str) -> str:
        return "rlc-" + hmac.new(self._secret, session_id.encode(), hashlib.sha256).hexdigest()[:40]

    def open_session(self, session_id: str, max_total_tokens: int) -> SessionAccess:
        if self.url is None:
            raise RuntimeError("start() the proxy before opening sessions")
        if session_id in self.sessions:
            raise ValueError(f"session {session_id!r} is already open")
        self.sessions[session_id] = ChatSession(session_id, self.delta, max_total_tokens)
        return SessionAccess(session_id, f"{self.url}/s/{session_id}/v1", self.api_key(session_id))

    def close_session(self, session_id: str) -> ChatSession:
        """The session, sealed and no longer served; ``.segments`` are its trajectories."""
        session = self.sessions.pop(session_id)
        session.finish()
        release = getattr(self.generator, "release", None)
        if release is not None:
            release(session_id)
        return session

    # ------------------------------------------------------------------ HTTP
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="rlcore chat proxy", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(HTTPException)
        async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
            return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code)

        @app.exception_handler(Exception)
        async def internal_error(_: Request, exc: Exception) -> JSONResponse:
            return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                                status_code=500)

        @app.get("/s/{session_id}/v1/models")
        async def models(session_id: str, request: Request):
            denied = self._deny(session_id, request)
            if denied is not None:
                return denied
            return {"object": "list", "data": [{"id": self.config.model_name, "object": "model", "created": 0,
                                                "owned_by": "rlcore"}]}

        @app.post("/s/{session_id}/v1/chat/completions")
        async def chat_completions(session_id: str, request: Request):
            denied = self._deny(session_id, request)
            if denied is not None:
                return denied
            try:
                body = await self._read_json(request)
                req = parse_request(body)
                req.check_supported(self.config.max_n)
                return await self._complete(self.sessions[session_id], req)
            except RequestError as exc:
                status = 413 if exc.code == "request_too_large" else 400
                return JSONResponse(error_body(str(exc), code=exc.code, param=exc.param), status_code=status)
            except asyncio.TimeoutError:
                return JSONResponse(error_body(f"generation did not finish within {self.config.request_timeout_s:g}s",
                                               "server_error", code="timeout"), status_code=504)

        return app

    def _deny(self, session_id: str, request: Request) -> JSONResponse | None:
        """401 without this session's key (checked first: an unknown id leaks nothing), 404 when closed."""
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), self.api_key(session_id).encode()):
            return JSONResponse(error_body("invalid API key for this session", code="invalid_api_key"),
                                status_code=401)
        if session_id not in self.sessions:
            return JSONResponse(error_body(f"session {session_id!r} is not open", code="session_not_found"),
                                status_code=404)
        return None

    async def _read_json(self, request: Request) -> Any:
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        too_big = RequestError(f"the request body is over {limit} bytes", code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise too_big
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not valid JSON: {exc}") from None

    def _sampling_for(self, req: ChatRequest, room: int) -> SamplingSettings:
        s = self.sampling
        wanted = req.max_completion_tokens or req.max_tokens or s.max_new_tokens
        changes: dict[str, Any] = {"n": 1, "max_new_tokens": min(wanted, s.max_new_tokens, room),
                                   "stop": tuple(dict.fromkeys(s.stop + req.stops)),
                                   "top_logprobs": (req.top_logprobs or 0) if req.logprobs else 0}
        if self.config.client_sampling:
            if req.temperature is not None:
                changes.update(temperature=req.temperature, do_sample=req.temperature > 0)
            if req.top_p is not None:
                changes["top_p"] = req.top_p
        return replace(s, **changes)

    async def _complete(self, session: ChatSession, req: ChatRequest):
        if req.stream:
            return await self._stream(session, req)
        async with session.lock:
            context = session.context_for(req.messages, req.tools)
            sampling = self._sampling_for(req, session.room())
            completions = await asyncio.wait_for(
                asyncio.gather(*[self.generator.generate(context, sampling, session.session_id)
                                 for _ in range(req.n)]), timeout=self.config.request_timeout_s)
            if any(c.finish_reason == "abort" for c in completions):
                return JSONResponse(error_body("the engine aborted the request", "server_error", code="aborted"),
                                    status_code=503)
            replies, finish, pieces = [], [], []
            for c in completions:
                reply, reason, token_pieces = self._reply(c, sampling.stop, req)
                replies.append(reply)
                finish.append(reason)
                pieces.append(token_pieces)
            session.record(replies)
        rid, model = completion_id(), self.config.model_name
        logprobs = [[lp for _, lp in p] for p in pieces] if req.logprobs else None
        return JSONResponse(completion_response(rid, model, len(context), replies, finish, logprobs))

    async def _stream(self, session: ChatSession, req: ChatRequest) -> StreamingResponse:
        """A streamed reply: the session's lock is taken here (a bad request is still a 4xx) and handed
        to the turn's producer, which releases it when done."""
        await asyncio.wait_for(session.lock.acquire(), timeout=self.config.request_timeout_s)
        try:
            context = session.context_for(req.messages, req.tools)
            turn = StreamedTurn(self, session, req, context, self._sampling_for(req, session.room()), completion_id())
        except BaseException:
            session.lock.release()
            raise
        return StreamingResponse(turn.start().events(), media_type="text/event-stream")

    def engine_stream(self, context: list[int], sampling: SamplingSettings, session_id: Hashable):
        """The generator's token stream for one choice; a generator that cannot stream gives the turn whole."""
        stream = getattr(self.generator, "generate_stream", None)
        if stream is not None:
            return stream(context, sampling, session_id)
        return _whole(self.generator.generate(context, sampling, session_id))

    def _reply(self, c, stops: tuple[str, ...], req: ChatRequest) -> tuple[Reply, str, list]:
        """The assistant message of one completion, its finish reason, and its content token by token
        (text, log-prob entry): the text before the first stop string, tool calls parsed out."""
        texts = self._token_texts(c.token_ids)
        full = "".join(texts)
        cut = min([i for i in (full.find(s) for s in stops) if i >= 0], default=len(full))
        text = full[:cut]
        content, calls = parse_tool_calls(text) if req.parse_tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        reason = "tool_calls" if calls else ("length" if c.finish_reason == "length" and cut == len(full) else "stop")
        reply = Reply(c, message)
        entries = logprobs_content(reply, self._token_text) if req.logprobs else [None] * len(texts)
        pieces, used = [], 0
        for piece, entry in zip(texts, entries):
            piece = piece[:max(cut - used, 0)]
            used += len(piece)
            if piece or entry is not None:
                pieces.append((piece, entry))
        return reply, reason, pieces

    def _token_text(self, token_id: int) -> str:
        return self.delta.codec.decode([token_id], skip_special_tokens=False)

    def _token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's share of the decoded text (special tokens as ''), joined: the whole text."""
        out, previous = [], ""
        for i in range(len(token_ids)):
            text = self.delta.codec.decode(token_ids[: i + 1], skip_special_tokens=True)
            out.append(text[len(previous):] if text.startswith(previous) else "")
            previous = text if text.startswith(previous) else previous
        return out


async def _whole(completion):
    yield await completion


def session_trajectories(session: ChatSession, reward: float, info: dict[str, float] | None = None,
                         episode: Hashable | None = None) -> list[Trajectory]:
    """A closed session's segments with the episode's reward (each segment gets all of it: they are
    one episode) and diagnostics."""
    for seg in session.segments:
        seg.reward, seg.terminated = float(reward), True
        seg.info.update(info or {})
        seg.metrics.update({"chat/segments": float(len(session.segments)), "chat/requests": float(session.requests),
                            "chat/discarded_replies": float(session.discarded_replies)})
        seg.episode_id = episode
    return session.segments

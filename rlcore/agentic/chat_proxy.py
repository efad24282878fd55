"""OpenAI- and Anthropic-compatible chat endpoints per session, token-exact: how a black-box agent is trained.

Why: much agent code owns its loop and talks to a model only through the OpenAI or the Anthropic
client (a request, tool calls, tool results, again). Point that client at ``ctx.base_url``
(``http://127.0.0.1:<port>/s/<session>/v1``, OpenAI's) or ``ctx.session_url`` (the same without
``/v1``: Anthropic's client adds ``/v1/messages`` itself) and every request of the episode is
served by the policy: the session in the URL path keeps all its turns on one engine (the
session-sticky router) and in one token-exact trajectory (``rlcore.agentic.chat_session``), so
the agent needs no ``extra_body`` and no change at all.

Routes (all three wire formats are decoded into one canonical request, ``openai_wire.ChatRequest``,
and generated alike, ``rlcore.agentic.chat_turn``):
    POST /s/{session}/v1/chat/completions   OpenAI's (``openai_wire``): non-streaming, or SSE deltas
                                            with ``stream=true`` (``stream_options.include_usage``);
                                            n, max_tokens / max_completion_tokens, stop, logprobs /
                                            top_logprobs, tools -> structured ``tool_calls``,
                                            tool_choice; real ``usage``
    POST /s/{session}/v1/responses          OpenAI's Responses API (``responses_wire``,
                                            ``responses_route``): input as a string or message /
                                            function_call / function_call_output items,
                                            instructions, function tools, tool_choice,
                                            max_output_tokens, previous_response_id (within the
                                            session), Response objects with usage, and the
                                            response.created ... response.completed event stream
    POST /s/{session}/v1/messages           Anthropic's (``anthropic_wire``): system, text /
                                            tool_use / tool_result blocks, tools with input_schema,
                                            tool_choice, stop_sequences, max_tokens, usage, and the
                                            message_start ... message_stop event stream
    POST /s/{session}/v1/messages/count_tokens   the request's prompt rendered whole, counted
    GET  /s/{session}/v1/models             the one model, ``model_name``
    anything else                           404, naming the routes served

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

Safety: binds 127.0.0.1 on a port the kernel picks; every request carries the key, as ``Bearer
<key>`` (OpenAI) or ``x-api-key`` (Anthropic), where the key is an HMAC of the session id under a
per-run secret, so one session's key opens no other session; bodies over ``max_request_bytes``
get a 413; any error is the wire format's error body with a 4xx or 5xx, never a dead server.
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
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from rlcore.agentic.anthropic_wire import (
    MAX_STOP_SEQUENCES,
    AnthropicStream,
    anthropic_error,
    message_id,
    message_response,
    parse_messages_request,
)
from rlcore.agentic.chat import ChatDelta
from rlcore.agentic.chat_session import ChatSession, RequestError, template_message
from rlcore.agentic.chat_stream import StreamedTurn
from rlcore.agentic.chat_turn import TurnMaker
from rlcore.agentic.episode import Generator, Trajectory
from rlcore.agentic.openai_wire import (
    ChatRequest,
    OpenAIStream,
    completion_id,
    completion_response,
    error_body,
    parse_request,
)
from rlcore.agentic.responses_route import ResponsesRoute
from rlcore.engines.base import SamplingSettings


@dataclass(frozen=True)
class ChatProxyConfig:
    host: str = "127.0.0.1"  # loopback: agents run on this machine
    port: int = 0  # 0: a free port the kernel picks
    model_name: str = "policy"
    max_request_bytes: int = 1 << 20
    max_n: int = 8  # choices per request
    max_stops: int = 4  # stop strings per OpenAI request (OpenAI's own limit)
    client_sampling: bool = False  # honour the request's temperature / top_p (not for training)
    request_timeout_s: float = 300.0  # one request's generation


@dataclass(frozen=True)
class SessionAccess:
    """What an agent needs to reach its session."""

    session_id: str
    base_url: str  # for openai.AsyncOpenAI(base_url=...): <session_url>/v1
    api_key: str
    session_url: str  # for anthropic.AsyncAnthropic(base_url=...), which adds /v1/messages itself


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the host process (a test, a Ray actor) owns its signals
        yield


class ChatProxy:
    def __init__(self, generator: Generator, tokenizer: Any, sampling: SamplingSettings,
                 config: ChatProxyConfig = ChatProxyConfig(), secret: bytes | None = None) -> None:
        self.generator, self.tokenizer, self.sampling, self.config = generator, tokenizer, sampling, config
        self.delta = ChatDelta(tokenizer)
        self.turns = TurnMaker(generator, tokenizer, sampling, self.delta, config.client_sampling)
        self._secret = secret or secrets.token_bytes(32)
        self.sessions: dict[str, ChatSession] = {}
        self.responses = ResponsesRoute(self.turns, self.sessions, config.model_name, config.request_timeout_s,
                                        config.max_stops)
        self.url: str | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        # the generation routes, by path after /s/{session}/: served by _asgi without FastAPI's machinery
        self._generation_routes = {"v1/chat/completions": self._serve_chat, "v1/responses": self._serve_responses,
                                   "v1/messages": self._serve_messages}
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
        # Per request, nothing more than a reply needs: no X-Forwarded-For reading (no one reads the
        # client's address), no date and server headers for the client to parse.
        config = uvicorn.Config(self._asgi, interface="asgi3", log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30, proxy_headers=False, server_header=False, date_header=False)
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
        root = f"{self.url}/s/{session_id}"
        return SessionAccess(session_id, f"{root}/v1", self.api_key(session_id), root)

    def close_session(self, session_id: str) -> ChatSession:
        """The session, sealed and no longer served; ``.segments`` are its trajectories."""
        session = self.sessions.pop(session_id)
        session.finish()
        release = getattr(self.generator, "release", None)
        if release is not None:
            release(session_id)
        return session

    # ------------------------------------------------------------------ HTTP
    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The server's app: a generation request goes straight to ``_serve``; the rest to the FastAPI app.

        Why: FastAPI's middleware, routing and dependency solving cost a request more than the session's
        own work does (~0.1-0.2 ms of CPU, ``benchmarks/chat_proxy.py``), and with many short turns that is
        time the agents' event loop (and on a small machine, the engine) does not get. The routes taken
        here are FastAPI's too (``_build_app``), served alike; an error raised while building the
        response is the same 500 body, then raised on for the server to log, as Starlette does."""
        route = self._generation_route(scope) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        session_id, serve = route
        request = Request(scope, receive)
        try:
            response = await serve(session_id, request)
        except Exception as exc:
            await self._internal_error(request, exc)(scope, receive, send)
            raise
        await response(scope, receive, send)

    def _generation_route(self, scope: Scope) -> tuple[str, Any] | None:
        """``(session_id, serve)`` for ``POST /s/{session_id}/v1/chat/completions``, ``.../v1/responses``
        or ``.../v1/messages`` (a session id is one path segment, as FastAPI matches ``{session_id}``)."""
        path = scope["path"]
        if not path.startswith("/s/"):
            return None
        session_id, _, tail = path[3:].partition("/")
        serve = self._generation_routes.get(tail)
        return (session_id, serve) if session_id and serve is not None else None

    def _internal_error(self, request: Request, exc: Exception) -> JSONResponse:
        return self._error(request, 500, f"internal error: {type(exc).__name__}: {exc}", code="server_error")

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="rlcore chat proxy", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
            if exc.status_code in (404, 405):  # no route for this method and path: say which there are
                served = ", ".join(f"{m} {r.path}" for r in app.routes if isinstance(r, APIRoute)
                                   for m in sorted(r.methods))
                return self._error(request, 404, f"no route {request.method} {request.url.path}; served: {served}",
                                   code="route_not_found")
            return self._error(request, exc.status_code, str(exc.detail), code=str(exc.status_code))

        @app.exception_handler(Exception)
        async def internal_error(request: Request, exc: Exception) -> JSONResponse:
            return self._internal_error(request, exc)

        @app.get("/s/{session_id}/v1/models")
        async def models(session_id: str, request: Request):
            denied = self._deny(session_id, request)
            if denied is not None:
                return denied
            return {"object": "list", "data": [{"id": self.config.model_name, "object": "model", "created": 0,
                                                "owned_by": "rlcore"}]}

        for tail, serve in self._generation_routes.items():  # served by _asgi; here for the route list
            app.add_api_route(f"/s/{{session_id}}/{tail}", serve, methods=["POST"])

        @app.post("/s/{session_id}/v1/messages/count_tokens")
        async def count_tokens(session_id: str, request: Request):
            """The request's prompt rendered whole, counted (what a fresh session would start from)."""
            denied = self._deny(session_id, request)
            if denied is not None:
                return denied
            try:
                body = await self._read_json(request)
                req = parse_messages_request({"max_tokens": 1, **body} if isinstance(body, dict) else body)
                req.tool_mode()
                msgs = [template_message(m, i) for i, m in enumerate(req.messages)]
                tools = {"tools": req.rendered_tools} if req.rendered_tools else {}
                return {"input_tokens": len(self.delta.prompt(msgs, **tools))}
            except RequestError as exc:
                return self._error(request, 413 if exc.code == "request_too_large" else 400, str(exc))

        return app

    async def _serve_chat(self, session_id: str, request: Request):
        return await self._serve(session_id, request, parse_request, self.config.max_stops)

    async def _serve_messages(self, session_id: str, request: Request):
        return await self._serve(session_id, request, parse_messages_request, MAX_STOP_SEQUENCES)

    async def _serve_responses(self, session_id: str, request: Request):
        denied = self._deny(session_id, request)
        if denied is not None:
            return denied
        try:
            return await self.responses.serve(self.sessions[session_id], await self._read_json(request))
        except RequestError as exc:
            return self._error(request, 413 if exc.code == "request_too_large" else 400, str(exc), code=exc.code,
                               param=exc.param)
        except TimeoutError:
            return self._error(request, 504, f"generation did not finish within {self.config.request_timeout_s:g}s",
                               code="timeout")

    async def _serve(self, session_id: str, request: Request, parse, max_stops: int):
        """One request on either wire: checked, decoded into the canonical request, generated."""
        denied = self._deny(session_id, request)
        if denied is not None:
            return denied
        try:
            req = parse(await self._read_json(request))
            req.check_supported(self.config.max_n, max_stops)
            return await self._complete(self.sessions[session_id], req, anthropic=parse is parse_messages_request)
        except RequestError as exc:
            status = 413 if exc.code == "request_too_large" else 400
            message = str(exc)
            if exc.code == "context_length_exceeded" and parse is parse_messages_request:
                message = f"prompt is too long: {message}"  # how Anthropic's API words it, for agents that check
            return self._error(request, status, message, code=exc.code, param=exc.param)
        except TimeoutError:
            return self._error(request, 504, f"generation did not finish within {self.config.request_timeout_s:g}s",
                               code="timeout")

    @staticmethod
    def _error(request: Request, status: int, message: str, code: str | None = None,
               param: str | None = None) -> JSONResponse:
        """An error in the request's wire format: Anthropic's on /v1/messages, OpenAI's elsewhere."""
        if "/v1/messages" in request.url.path:
            return JSONResponse(anthropic_error(status, message), status_code=status)
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return JSONResponse(error_body(message, kind, code=code, param=param), status_code=status)

    def _deny(self, session_id: str, request: Request) -> JSONResponse | None:
        """401 without this session's key (checked first: an unknown id leaks nothing), 404 when closed.
        The key comes as ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key`` (Anthropic's)."""
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), self.api_key(session_id).encode()):
            return self._error(request, 401, "invalid API key for this session", code="invalid_api_key")
        if session_id not in self.sessions:
            return self._error(request, 404, f"session {session_id!r} is not open", code="session_not_found")
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

    async def _complete(self, session: ChatSession, req: ChatRequest, anthropic: bool):
        if req.stream:
            return await self._stream(session, req, anthropic)
        async with session.lock:
            turn = self.turns.prepare(session, req)
            completions = await self.turns.complete(turn, req.n, session.session_id, self.config.request_timeout_s)
            if any(c.finish_reason == "abort" for c in completions):
                return JSONResponse(anthropic_error(503, "the engine aborted the request") if anthropic else
                                    error_body("the engine aborted the request", "server_error", code="aborted"),
                                    status_code=503)
            choices = [self.turns.choice(c, turn, req) for c in completions]
            session.record([c.reply for c in choices])
        model = self.config.model_name
        if anthropic:
            return JSONResponse(message_response(message_id(), model, len(turn.prompt), choices[0]))
        return JSONResponse(completion_response(completion_id(), model, len(turn.prompt), choices, req.logprobs))

    async def _stream(self, session: ChatSession, req: ChatRequest, anthropic: bool) -> StreamingResponse:
        """A streamed reply: the session's lock is taken here (a bad request is still a 4xx) and handed
        to the turn's producer, which releases it when done."""
        await asyncio.wait_for(session.lock.acquire(), timeout=self.config.request_timeout_s)
        try:
            turn = self.turns.prepare(session, req)
            model = self.config.model_name
            fmt = (AnthropicStream(message_id(), model, len(turn.prompt)) if anthropic
                   else OpenAIStream(completion_id(), model, req))
            streamed = StreamedTurn(self.turns, session, req, turn, self.config.request_timeout_s, fmt)
        except BaseException:
            session.lock.release()
            raise
        return StreamingResponse(streamed.start().events(), media_type="text/event-stream")


def session_trajectories(session: ChatSession, reward: float, info: dict[str, float] | None = None,
                         episode: Hashable | None = None) -> list[Trajectory]:
    """A closed session's segments with the episode's reward (each segment gets all of it: they are
    one episode) and diagnostics."""
    for seg in session.segments:
        seg.reward, seg.terminated = float(reward), True
        seg.info.update(info or {})
        seg.metrics.update({"chat/segments": float(len(session.segments)), "chat/requests": float(session.requests),
                            "chat/tries": float(session.tries),
                            "chat/discarded_replies": float(session.discarded_replies),
                            "chat/rerendered_matched": float(session.rerendered_matched),
                            "chat/rerendered_unmatched": float(session.rerendered_unmatched)})
        seg.episode_id = episode
    return session.segments

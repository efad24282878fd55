"""``POST /s/{session}/v1/responses``: a Responses request served on a session, streamed or not.

Why a module of its own: unlike the chat and Messages routes, a Responses request may continue an
earlier response by id (``previous_response_id``), so serving one needs the session's kept
responses on top of the shared path (``chat_turn.TurnMaker``, ``chat_stream.StreamedTurn``):
the conversation it continues is looked up, decoded with the request's items into the canonical
request (``responses_wire.chat_request``), generated, and the new response's conversation (its
input after the previous one's, then its reply) is kept under its id, unless ``store`` is false.
Since that conversation ends with the reply exactly as the session recorded it, a continued
request extends the session like a resent history does: only the new items' delta is rendered.

An id is looked up in its own session only (a session's responses die with it); one from another
open session, one never issued, and one made with ``store: false`` are each a 400 that says which.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from rlcore.agentic.chat_session import ChatSession, RequestError
from rlcore.agentic.chat_stream import StreamedTurn
from rlcore.agentic.chat_turn import TurnMaker
from rlcore.agentic.openai_wire import ChatRequest, error_body
from rlcore.agentic.responses_stream import ResponsesStream
from rlcore.agentic.responses_wire import (
    ResponsesRequest,
    chat_request,
    parse_responses_request,
    response_body,
    response_id,
)


class ResponsesRoute:
    def __init__(self, turns: TurnMaker, sessions: Mapping[str, ChatSession], model_name: str,
                 timeout_s: float, max_stops: int) -> None:
        self.turns, self.sessions, self.model_name = turns, sessions, model_name
        self.timeout_s, self.max_stops = timeout_s, max_stops

    async def serve(self, session: ChatSession, body: Any):
        req = parse_responses_request(body)
        if req.stream:
            return await self._stream(session, req)
        async with session.lock:
            chat, conversation = self._decode(session, req)
            turn = self.turns.prepare(session, chat)
            [completion] = await self.turns.complete(turn, 1, session.session_id, self.timeout_s)
            if completion.finish_reason == "abort":
                return JSONResponse(error_body("the engine aborted the request", "server_error", code="aborted"),
                                    status_code=503)
            choice = self.turns.choice(completion, turn, chat)
            session.record([choice.reply])
            body = response_body(response_id(), self.model_name, req, len(turn.prompt), choice)
            self._keep(session, body["id"], req, conversation, choice)
        return JSONResponse(body)

    async def _stream(self, session: ChatSession, req: ResponsesRequest) -> StreamingResponse:
        """As ``ChatProxy._stream``: the lock is handed to the turn's producer, which releases it."""
        await asyncio.wait_for(session.lock.acquire(), timeout=self.timeout_s)
        try:
            chat, conversation = self._decode(session, req)
            turn = self.turns.prepare(session, chat)
            rid = response_id()
            fmt = ResponsesStream(rid, self.model_name, req,
                                  lambda choice, _: self._keep(session, rid, req, conversation, choice))
            streamed = StreamedTurn(self.turns, session, chat, turn, self.timeout_s, fmt)
        except BaseException:
            session.lock.release()
            raise
        return StreamingResponse(streamed.start().events(), media_type="text/event-stream")

    def _decode(self, session: ChatSession, req: ResponsesRequest) -> tuple[ChatRequest, list[dict[str, Any]]]:
        chat, conversation = chat_request(req, self._history(session, req.previous_response_id))
        chat.check_supported(1, self.max_stops)
        return chat, conversation

    def _history(self, session: ChatSession, rid: str | None) -> list[dict[str, Any]]:
        if rid is None:
            return []
        if rid in session.responses:
            kept = session.responses[rid]
            if kept is None:
                raise RequestError(f"previous_response_id {rid!r} was created with store=false, so it was not kept; "
                                   "send the whole input instead", code="previous_response_not_found",
                                   param="previous_response_id")
            return kept
        elsewhere = any(rid in s.responses for s in self.sessions.values() if s is not session)
        whose = ("another session's response: a session continues only its own" if elsewhere
                 else "not a response of this session")
        raise RequestError(f"previous_response_id {rid!r} is {whose}", code="previous_response_not_found",
                           param="previous_response_id")

    @staticmethod
    def _keep(session: ChatSession, rid: str, req: ResponsesRequest, conversation: list[dict[str, Any]],
              choice: Any) -> None:
        session.responses[rid] = conversation + [choice.reply.message] if req.store else None

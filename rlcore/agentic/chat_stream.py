"""A streamed chat reply (``stream=true``): SSE events sent as the engine samples the tokens.

Why a module of its own: the non-streamed path is one await and one JSON body; a stream has two
sides that live apart. ``StreamedTurn`` runs a *producer* task, which holds the session's lock,
consumes the engine's ``generate_stream`` (one per choice), builds each choice's reply exactly
as the non-streamed path does (``TurnMaker.choice``) and records them in the session; and the
response's *event* generator, which turns the tokens into text as they come (``TextStream``:
stable text only, never part of a stop string or a tool call), then the tool calls whole, each
choice's end, the usage. What those events look like on the wire is the formatter's business
(``openai_wire.OpenAIStream``: chunks and ``[DONE]``; ``anthropic_wire.AnthropicStream``:
``message_start`` ... ``message_stop``).

A client that hangs up ends the event generator (Starlette cancels it); it cancels the producer,
which closes the engine streams (the engine drops the request at its next step) and records
nothing: the same request again regenerates from the same ids, as after any failed request. A
response that never starts streaming leaves the producer to finish within the request timeout
and record the reply, as a non-streamed request would. Every wait has the request's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Protocol

from rlcore.agentic.chat_session import ChatSession
from rlcore.agentic.chat_turn import Choice, Turn, TurnMaker, gather_choices
from rlcore.agentic.openai_wire import ChatRequest, token_logprobs
from rlcore.agentic.stream_text import TextStream
from rlcore.engines.async_base import Completion, TokenChunk


class StreamFormat(Protocol):
    """A wire format's streamed events: each method returns the SSE texts to send."""

    def start(self) -> list[str]: ...
    def text(self, index: int, text: str, logprobs: list[dict]) -> list[str]: ...
    def finish(self, index: int, rest: str, logprobs: list[dict], choice: Choice) -> list[str]: ...
    def end(self, prompt_tokens: int, choices: list[Choice]) -> list[str]: ...
    def error(self, message: str, kind: str, code: str) -> list[str]: ...


class StreamedTurn:
    def __init__(self, maker: TurnMaker, session: ChatSession, req: ChatRequest, turn: Turn,
                 timeout_s: float, fmt: StreamFormat) -> None:
        self.maker, self.session, self.req, self.turn, self.fmt = maker, session, req, turn, fmt
        self.timeout_s = timeout_s
        self.deadline = time.perf_counter() + timeout_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.producer: asyncio.Task | None = None

    def start(self) -> "StreamedTurn":
        """Start generating; the session's lock (held by the caller) is released when the producer ends,
        however it ends (a done callback: also when it is cancelled before it ever ran)."""
        self.producer = asyncio.get_running_loop().create_task(self._produce())
        self.producer.add_done_callback(lambda _: self.session.lock.release())
        return self

    # ------------------------------------------------------------------ producer
    async def _produce(self) -> None:
        try:
            choices = await gather_choices([self._choice(i) for i in range(self.req.n)],
                                           max(self.deadline - time.perf_counter(), 0))
            self.session.record([c.reply for c in choices])
            self.queue.put_nowait(("end", choices))
        except TimeoutError:
            self.queue.put_nowait(("error", f"generation did not finish within {self.timeout_s:g}s", "server_error",
                                   "timeout"))
        except Exception as exc:  # the client learns why, in the stream (its 200 is already sent)
            self.queue.put_nowait(("error", f"{type(exc).__name__}: {exc}", "server_error", "server_error"))

    async def _choice(self, index: int) -> Choice:
        items = self.maker.engine_stream(self.turn, self.session.session_id)
        async with contextlib.aclosing(items):
            async for item in items:
                if isinstance(item, Completion):
                    if item.finish_reason == "abort":
                        raise RuntimeError("the engine aborted the request")
                    choice = self.maker.choice(item, self.turn, self.req)
                    self.queue.put_nowait(("done", index, choice))
                    return choice
                self.queue.put_nowait(("chunk", index, item))
        raise RuntimeError("the engine's stream ended without a completion")

    # ------------------------------------------------------------------ events
    async def events(self) -> AsyncIterator[str]:
        req, fmt = self.req, self.fmt
        streams = [TextStream(self.maker.tokenizer, self.turn.sampling.stop, req.parse_tools) for _ in range(req.n)]
        for stream in streams:
            stream.push(self.turn.forced)  # a forced tool call's opening: held, as every call is
        entries: list[list[dict]] = [[] for _ in range(req.n)]  # log-prob entries not sent yet
        try:
            for event in fmt.start():
                yield event
            while True:
                remaining = self.deadline - time.perf_counter()
                try:
                    kind, *item = await asyncio.wait_for(self.queue.get(), timeout=max(remaining, 0) + 1.0)
                except asyncio.TimeoutError:  # the producer's own timeout comes first; this is a backstop
                    kind, item = "error", ["the stream stalled", "server_error", "timeout"]
                if kind == "chunk":
                    i, part = item
                    text = self._push(streams[i], entries[i], part)
                    if text:
                        for event in fmt.text(i, text, entries[i]):
                            yield event
                        entries[i] = []
                elif kind == "done":
                    i, choice = item
                    for event in fmt.finish(i, streams[i].finish(choice.reply.message.get("content")), entries[i],
                                            choice):
                        yield event
                elif kind == "error":
                    for event in fmt.error(*item):
                        yield event
                    return
                else:  # "end": every choice done and recorded
                    for event in fmt.end(len(self.turn.prompt), item[0]):
                        yield event
                    return
        finally:
            if self.producer is not None and not self.producer.done():
                self.producer.cancel()  # the client went away: stop generating

    def _push(self, stream: TextStream, entries: list[dict], part: TokenChunk) -> str:
        if self.req.logprobs:
            entries += token_logprobs(part.token_ids, part.log_probs, part.top_logprobs, self.maker.token_text)
        return stream.push(part.token_ids)


"""A streamed chat reply (``stream=true``): SSE deltas sent as the engine samples the tokens.

Why a module of its own: the non-streamed path is one await and one JSON body; a stream has two
sides that live apart. ``StreamedTurn`` runs a *producer* task, which holds the session's lock,
consumes the engine's ``generate_stream`` (one per choice), builds each choice's reply exactly
as the non-streamed path does (``ChatProxy._reply``) and records them in the session; and the
response's *event* generator, which turns the tokens into deltas as they come (``TextStream``:
stable text only, never part of a stop string or a tool call), then the tool calls whole, each
choice's finish reason, the usage, ``[DONE]``.

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
from typing import Any

from rlcore.agentic.chat_session import ChatSession, Reply
from rlcore.agentic.openai_wire import ChatRequest, chunk, delta, error_body, sse, token_logprobs, usage
from rlcore.agentic.stream_text import TextStream
from rlcore.engines.async_base import Completion, TokenChunk
from rlcore.engines.base import SamplingSettings


class StreamedTurn:
    def __init__(self, proxy: Any, session: ChatSession, req: ChatRequest, context: list[int],
                 sampling: SamplingSettings, rid: str) -> None:
        self.proxy, self.session, self.req, self.context, self.sampling, self.rid = \
            proxy, session, req, context, sampling, rid
        self.deadline = time.perf_counter() + proxy.config.request_timeout_s
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
            done = await asyncio.wait_for(asyncio.gather(*[self._choice(i) for i in range(self.req.n)]),
                                          timeout=max(self.deadline - time.perf_counter(), 0))
            self.session.record([reply for reply, _ in done])
            self.queue.put_nowait(("end", [reply for reply, _ in done]))
        except asyncio.TimeoutError:
            self.queue.put_nowait(("error", error_body(f"generation did not finish within "
                                                       f"{self.proxy.config.request_timeout_s:g}s", "server_error",
                                                       code="timeout")))
        except Exception as exc:  # the client learns why, in the stream (its 200 is already sent)
            self.queue.put_nowait(("error", error_body(f"{type(exc).__name__}: {exc}", "server_error")))

    async def _choice(self, index: int) -> tuple[Reply, str]:
        items = self.proxy.engine_stream(self.context, self.sampling, self.session.session_id)
        async with contextlib.aclosing(items):
            async for item in items:
                if isinstance(item, Completion):
                    if item.finish_reason == "abort":
                        raise RuntimeError("the engine aborted the request")
                    reply, reason, _ = self.proxy._reply(item, self.sampling.stop, self.req)
                    self.queue.put_nowait(("done", index, reply, reason))
                    return reply, reason
                self.queue.put_nowait(("chunk", index, item))
        raise RuntimeError("the engine's stream ended without a completion")

    # ------------------------------------------------------------------ events
    async def events(self) -> AsyncIterator[str]:
        req, model, created = self.req, self.proxy.config.model_name, int(time.time())
        streams = [TextStream(self.proxy.tokenizer, self.sampling.stop, req.parse_tools) for _ in range(req.n)]
        entries: list[list[dict]] = [[] for _ in range(req.n)]  # log-prob entries not sent yet
        try:
            for i in range(req.n):
                yield sse(chunk(self.rid, model, created, [delta(i, {"role": "assistant", "content": ""})]))
            while True:
                remaining = self.deadline - time.perf_counter()
                try:
                    kind, *item = await asyncio.wait_for(self.queue.get(), timeout=max(remaining, 0) + 1.0)
                except asyncio.TimeoutError:  # the producer's own timeout comes first; this is a backstop
                    yield sse({**error_body("the stream stalled", "server_error", code="timeout")})
                    return
                if kind == "chunk":
                    i, part = item
                    text = self._push(streams[i], entries[i], part)
                    if text:
                        yield sse(chunk(self.rid, model, created, [delta(i, {"content": text}, logprobs=entries[i])]))
                        entries[i] = []
                elif kind == "done":
                    i, reply, reason = item
                    for event in self._finish_choice(i, streams[i], entries[i], reply, reason, model, created):
                        yield sse(event)
                elif kind == "error":
                    yield sse(item[0])
                    return
                else:  # "end": every choice done and recorded
                    if req.stream_options and req.stream_options.include_usage:
                        yield sse(chunk(self.rid, model, created, [], usage=usage(len(self.context), item[0])))
                    yield sse("[DONE]")
                    return
        finally:
            if self.producer is not None and not self.producer.done():
                self.producer.cancel()  # the client went away: stop generating

    def _push(self, stream: TextStream, entries: list[dict], part: TokenChunk) -> str:
        if self.req.logprobs:
            entries += token_logprobs(part.token_ids, part.log_probs, part.top_logprobs, self.proxy._token_text)
        return stream.push(part.token_ids)

    def _finish_choice(self, i: int, stream: TextStream, entries: list[dict], reply: Reply, reason: str,
                       model: str, created: int) -> list[dict]:
        """The rest of a choice's content, its tool calls whole, its finish reason."""
        events = []
        rest = stream.finish(reply.message.get("content"))
        if rest or entries:
            events.append(chunk(self.rid, model, created, [delta(i, {"content": rest}, logprobs=entries)]))
        for k, call in enumerate(reply.message.get("tool_calls") or []):
            events.append(chunk(self.rid, model, created, [delta(i, {"tool_calls": [{"index": k, **call}]})]))
        events.append(chunk(self.rid, model, created, [delta(i, {}, finish_reason=reason)]))
        return events

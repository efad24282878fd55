"""One request's generation, whatever wire format it came in on (OpenAI's or Anthropic's).

Why a module of its own: both wire formats are decoded into one canonical request
(``openai_wire.ChatRequest``); from there on, what the session renders, how the engine is asked,
and what the reply is (text cut at the first stop string, tool calls parsed out, the finish
reason, the stop string that ended it) is the same, and is kept here so that both routes give
the same ids for the same conversation. Only the reply's shape on the wire differs
(``openai_wire``, ``anthropic_wire``).

A forced tool choice (OpenAI's ``"required"`` or a named function, Anthropic's ``any`` / ``tool``)
is honoured by starting the assistant turn with the template's tool-call opening
(``ChatDelta.tool_call_opening``): ``<tool_call>{"name": "`` for "required" (the model picks the
function), ``<tool_call>{"name": "calc", "arguments": `` for a named one (the model writes the
arguments). Those ids are context, not sampled: the session records them masked between the
prompt and the model's tokens (``Reply.forced``), so the trajectory stays exactly what the policy
saw. The engines have no grammar-constrained decoding, so a model that writes a malformed call
after the opening gets its text back as content (finish reason ``stop``), as any malformed call.

``gather_choices`` runs a request's choices as tasks and, however it ends (a timeout, a client that
hung up, an error), cancels and awaits every one of them: a bare ``asyncio.gather`` under
``wait_for`` left a cancelled ``_GatheringFuture`` whose exception nobody retrieved, and asyncio
printed a traceback for every hang-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rlcore.agentic.chat import ChatDelta
from rlcore.agentic.chat_session import ChatSession, Reply, RequestError
from rlcore.agentic.episode import Generator
from rlcore.agentic.openai_wire import ChatRequest, logprobs_content
from rlcore.agentic.stream_text import TOOL_CALL_OPEN
from rlcore.agentic.tool_calls import parse_tool_calls
from rlcore.engines.base import SamplingSettings


@dataclass
class Choice:
    """One choice's reply, canonical: the message, why it ended, and its content token by token."""

    reply: Reply
    finish: str  # "stop" | "length" | "tool_calls"
    stop_sequence: str | None  # the stop string that ended it, if one did
    pieces: list[tuple[str, dict | None]]  # (text, log-prob entry) per token of the content


@dataclass
class Turn:
    """A request, prepared: the ids to generate on, the forced opening, the sampling."""

    context: list[int]
    forced: list[int]
    sampling: SamplingSettings

    @property
    def prompt(self) -> list[int]:
        return self.context + self.forced


async def gather_choices(coros: Sequence[Awaitable], timeout_s: float) -> list:
    """The results of ``coros`` run as tasks, within ``timeout_s``; on any exit but success every
    task is cancelled and awaited (nothing is left unretrieved)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        async with asyncio.timeout(timeout_s):
            return [await t for t in tasks]
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
        for t in tasks:  # retrieve every outcome: no "exception was never retrieved"
            if not t.cancelled():
                t.exception()


class TurnMaker:
    """Prepares requests on a session, asks the engine, and builds the replies."""

    def __init__(self, generator: Generator, tokenizer: Any, sampling: SamplingSettings, delta: ChatDelta,
                 client_sampling: bool) -> None:
        self.generator, self.tokenizer, self.sampling, self.delta = generator, tokenizer, sampling, delta
        self.client_sampling = client_sampling

    def prepare(self, session: ChatSession, req: ChatRequest) -> Turn:
        """The turn's context in the session (which records the request), its forced opening, its sampling."""
        forced = self._forced(req)
        context = session.context_for(req.messages, req.rendered_tools)
        room = session.room() - len(forced)
        if room < 1:
            raise RequestError(f"this session has no room left to reply ({session.max_total_tokens} tokens)",
                               code="context_length_exceeded", param="messages")
        return Turn(context, forced, self._sampling_for(req, room))

    def _forced(self, req: ChatRequest) -> list[int]:
        mode, name = req.tool_mode()
        if mode not in ("required", "function"):
            return []
        opening = self.delta.tool_call_opening(req.rendered_tools, name)
        if opening is None or TOOL_CALL_OPEN not in opening:
            raise RequestError(f"tool_choice {mode!r} is not supported with this model: its chat template does not "
                               f"write tool calls as {TOOL_CALL_OPEN}{{\"name\": ..., \"arguments\": ...}}</tool_call>",
                               param="tool_choice")
        return self.delta.encode(opening)

    def _sampling_for(self, req: ChatRequest, room: int) -> SamplingSettings:
        s = self.sampling
        wanted = req.max_completion_tokens or req.max_tokens or s.max_new_tokens
        changes: dict[str, Any] = {"n": 1, "max_new_tokens": min(wanted, s.max_new_tokens, room),
                                   "stop": tuple(dict.fromkeys(s.stop + req.stops)),
                                   "top_logprobs": (req.top_logprobs or 0) if req.logprobs else 0}
        if self.client_sampling:
            if req.temperature is not None:
                changes.update(temperature=req.temperature, do_sample=req.temperature > 0)
            if req.top_p is not None:
                changes["top_p"] = req.top_p
            top_k = getattr(req, "top_k", None)  # Anthropic's top_k
            if isinstance(top_k, int) and top_k >= 0:
                changes["top_k"] = top_k
        return replace(s, **changes)

    async def complete(self, turn: Turn, n: int, session_id: Hashable, timeout_s: float) -> list:
        """``n`` completions of the turn, generated at once."""
        return await gather_choices([self.generator.generate(turn.prompt, turn.sampling, session_id)
                                     for _ in range(n)], timeout_s)

    def engine_stream(self, turn: Turn, session_id: Hashable):
        """The generator's token stream for one choice; a generator that cannot stream gives the turn whole."""
        stream = getattr(self.generator, "generate_stream", None)
        if stream is not None:
            return stream(turn.prompt, turn.sampling, session_id)
        return _whole(self.generator.generate(turn.prompt, turn.sampling, session_id))

    def choice(self, c, turn: Turn, req: ChatRequest) -> Choice:
        """The assistant message of one completion: the text (the forced opening, then the model's) before
        the first stop string, tool calls parsed out; its finish reason; its content token by token."""
        texts = self.token_texts(turn.forced + c.token_ids)
        full = "".join(texts)
        found = [(i, s) for s in turn.sampling.stop for i in [full.find(s)] if i >= 0]
        cut, stop_sequence = min(found) if found else (len(full), None)
        text = full[:cut]
        content, calls = parse_tool_calls(text) if req.parse_tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        reason = "tool_calls" if calls else ("length" if c.finish_reason == "length" and cut == len(full) else "stop")
        reply = Reply(c, message, forced=list(turn.forced))
        entries = [None] * len(turn.forced) + (logprobs_content(reply, self.token_text) if req.logprobs
                                               else [None] * len(c.token_ids))
        pieces, used = [], 0
        for piece, entry in zip(texts, entries):
            piece = piece[:max(cut - used, 0)]
            used += len(piece)
            if piece or entry is not None:
                pieces.append((piece, entry))
        return Choice(reply, reason, stop_sequence if not calls else None, pieces)

    def token_text(self, token_id: int) -> str:
        return self.delta.codec.decode([token_id], skip_special_tokens=False)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's share of the decoded text (special tokens as ''), joined: the whole text."""
        out, previous = [], ""
        for i in range(len(token_ids)):
            text = self.delta.codec.decode(token_ids[: i + 1], skip_special_tokens=True)
            out.append(text[len(previous):] if text.startswith(previous) else "")
            previous = text if text.startswith(previous) else previous
        return out


async def _whole(completion):
    yield await completion

"""One chat session's token-exact trajectory, built from the OpenAI requests of a black-box agent.

Why not render each request whole: the agent sends its whole conversation every time, as text.
Rendering it through the chat template again and tokenizing need not give back the ids the
policy sampled (merges, whitespace, a template that drops earlier reasoning), and the trainer
would then score a sequence the sampler never produced. So a session keeps the exact ids: the
first request is rendered whole (the segment's prompt), and each later request that *extends*
the conversation (its messages are the previous request's, then the reply we gave, then new
ones) adds only the new messages' delta (``ChatDelta.after_model_turn``) after the sampled ids.

A request that does not extend it (the agent compacted or edited its history, changed its tools)
seals the segment and starts a new one from that request's full rendering; the episode's
segments share its reward and group. The same request sent again (a client retry, a stream
the client dropped) generates again from the same context, the unseen reply discarded. With
``n > 1`` choices, the one the next request continues is kept (the others are discarded); when
no request follows, the agent is taken to have used ``choices[0]``, as nearly every agent does.

A request that does not extend it structurally may still re-send the same conversation in another
form (a framework that rebuilds its history each step, changes a tool's description, or writes the
model's turn back as text): it is matched to what was sampled before a segment is sealed
(the rule below), and continues the segment when the model would see the very same ids.

A session's requests are served one at a time (``lock``): its history is a single line.

``tries`` counts the agent's attempts at its task, for ``episode/first_try_right``: the first
request opens one, a request that adds a *user* message after the model's reply opens the next
(the agent said "no, again"), and so does one that rewrites the history and ends with a user
message; tool results, retries of the same request and extra choices do not (a tool-using agent's
one try takes several requests). In a history re-sent as text, a reply's tool calls come back as
assistant text and their results as a *user* message (smolagents' "Observation: ..."): that message
is the calls' result, not a new try, when the assistant text in the reply's place names every tool
call id the proxy gave that reply (ids it made up, ``call_<24 hex>``: no agent writes them by chance).

Re-rendered histories, the rule: when a request neither extends the session nor repeats the last
one, it continues the segment if, for one of the last replies, (1) the whole request rendered (with
its tools) starts with exactly the segment's ids up to the end of that reply's sampled tokens (an eos
the template does not write aside), or (2) its first messages are the segment's, then one assistant
message whose rendering re-tokenises to exactly the ids the model sampled: either way the policy
would have seen the very same ids, so only the new messages' delta is appended (``rerendered_matched``).
Otherwise the segment is sealed as above; a request that kept the segment's messages and put an
assistant message of its own in the reply's place counts as ``rerendered_unmatched`` (the model's
turn came back in a form it did not write: each such step trains as a segment of its own, on the
full rendering of what the agent sent, which is what a deployment would show the model).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlcore.agentic.chat import ChatDelta
from rlcore.agentic.episode import Trajectory
from rlcore.agentic.tool_calls import canonical_arguments
from rlcore.engines.async_base import Completion

ROLES = ("system", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the session cannot serve; ``code`` and ``param`` follow OpenAI's error body."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass
class Reply:
    """One choice returned to the agent: what was sampled, and the message the agent got."""

    completion: Completion
    message: dict[str, Any]
    forced: list[int] = field(default_factory=list)  # ids put before the model's (a forced tool call's opening)


def template_message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    """A wire message as the chat template takes it: text content (text parts joined), the tool
    calls of an assistant message, the ``tool_call_id`` / ``name`` of a tool result."""
    if not isinstance(message, Mapping):
        raise RequestError(f"messages[{index}] must be an object, got {type(message).__name__}",
                           param=f"messages[{index}]")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"messages[{index}].role must be one of {ROLES}, got {role!r}",
                           param=f"messages[{index}].role")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{index}].content[{j}]: only text parts are supported",
                                   param=f"messages[{index}].content")
            parts.append(part["text"])
        content = "".join(parts)
    elif content is not None and not isinstance(content, str):
        raise RequestError(f"messages[{index}].content must be a string, a list of text parts or null",
                           param=f"messages[{index}].content")
    out: dict[str, Any] = {"role": role, "content": content or ""}
    calls = message.get("tool_calls") or []
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise RequestError(f"messages[{index}].tool_calls: only an assistant message has a list of them",
                               param=f"messages[{index}].tool_calls")
        out["tool_calls"] = [_template_call(c, index) for c in calls]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = str(message[key])
    return out


def _template_call(call: Any, index: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise RequestError(f"messages[{index}].tool_calls: each call needs function.name and function.arguments",
                           param=f"messages[{index}].tool_calls")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": canonical_arguments(fn.get("arguments", {}))}}


def _same_message(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal as the template sees them (a tool call's id is the client's business)."""
    def key(m: Mapping[str, Any]) -> tuple:
        calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                      for c in m.get("tool_calls", []))
        return m["role"], m["content"], calls, m.get("tool_call_id"), m.get("name")
    return key(a) == key(b)


def _message_text(message: Mapping[str, Any]) -> str:
    calls = " ".join(json.dumps(c["function"]) for c in message.get("tool_calls", []))
    return f"{message['content']} {calls}"


def _names_calls(text: str, reply: Reply) -> bool:
    """Whether ``text`` names every tool call id of ``reply`` (False when it made no calls)."""
    ids = [c.get("id") for c in reply.message.get("tool_calls") or []]
    return bool(ids) and all(isinstance(i, str) and i in text for i in ids)


def _opens_try(after: Sequence[Mapping[str, Any]], calls_resent: bool) -> bool:
    """Whether the messages after the model's reply start a new try: a user message does, except the
    calls' result where the reply's tool calls came back in the history (``calls_resent``) and no
    tool message answers them: then the first message after is their result, re-rendered as a user
    message (smolagents' "Observation: ...")."""
    rest = list(after)
    if calls_resent and rest and rest[0]["role"] == "user":
        rest.pop(0)
    return any(m["role"] == "user" for m in rest)


@dataclass
class ChatSession:
    session_id: Hashable
    delta: ChatDelta
    max_total_tokens: int  # per segment: prompt + everything after it
    segments: list[Trajectory] = field(default_factory=list)  # sealed
    current: Trajectory | None = None
    known: list[dict[str, Any]] = field(default_factory=list)  # the messages the current context holds
    tools: list[Any] | None = None
    pending: list[Reply] = field(default_factory=list)  # the last request's replies, not yet continued
    requests: int = 0
    tries: int = 0
    discarded_replies: int = 0
    rerendered_matched: int = 0  # requests matched to the sampled ids though not extending structurally
    rerendered_unmatched: int = 0  # requests that re-sent the model's turn in a form it did not write
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Responses API: each response's conversation (input, then reply) by id, None if store=false
    responses: dict[str, list[dict[str, Any]] | None] = field(default_factory=dict)

    def context_for(self, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None = None) -> list[int]:
        """The exact ids to generate on for this request (see the module docstring)."""
        if not messages:
            raise RequestError("messages must hold at least one message", param="messages")
        msgs = [template_message(m, i) for i, m in enumerate(messages)]
        self.requests += 1
        kwargs = {"tools": tools} if tools else {}
        if self.current is not None and tools == self.tools:
            n = len(self.known)
            extends = len(msgs) > n + 1 and all(_same_message(a, b) for a, b in zip(msgs[:n], self.known))
            for reply in self.pending if extends else []:
                if _same_message(msgs[n], template_message(reply.message, n)):
                    self._continue_with(reply)
                    self.tries += any(m["role"] == "user" for m in msgs[n + 1:])
                    ids = self.delta.after_model_turn(reply.completion.token_ids, msgs[n + 1:], **kwargs)
                    self._check_room(len(self.current) + len(ids))
                    self.current.add_observation(ids)
                    self.known = msgs
                    return self.current.context()
            if len(msgs) == n and all(_same_message(a, b) for a, b in zip(msgs, self.known)):
                self.discarded_replies += len(self.pending)  # the same request again
                self.pending = []
                return self.current.context()
        kept = self._resent_reply(msgs)  # (the reply re-sent in another form, where the new messages start, named)
        if kept is not None and self._rerendered(msgs, tools, kept[0], kept[1]):
            return self.current.context()
        self.rerendered_unmatched += kept is not None
        opens = _opens_try(msgs[kept[1]:], kept[2]) if kept is not None else msgs[-1]["role"] == "user"
        self._seal(kept[0] if kept is not None else None)
        self.tries += self.tries == 0 or opens
        prompt = self.delta.prompt(msgs, **kwargs)
        self._check_room(len(prompt))
        self.current, self.known, self.tools = Trajectory(prompt), msgs, tools
        return self.current.context()

    def _resent_reply(self, msgs: list[dict[str, Any]]) -> tuple[Reply, int, bool] | None:
        """When ``msgs`` keep the current context's messages and put assistant messages where the
        reply was: the reply they stand for (the one whose tool call ids they name, else the first),
        the index of the first message after them, and whether they name its calls' ids. None otherwise."""
        n = len(self.known)
        if (self.current is None or not self.pending or len(msgs) <= n or msgs[n]["role"] != "assistant"
                or not all(_same_message(a, b) for a, b in zip(msgs[:n], self.known))):
            return None
        end = n
        while end < len(msgs) and msgs[end]["role"] == "assistant":
            end += 1
        if end == len(msgs):
            return None  # nothing after it: no request for a next turn
        said = " ".join(_message_text(m) for m in msgs[n:end])
        for reply in self.pending:
            if _names_calls(said, reply):
                return reply, end, True
        return self.pending[0], end, False

    def _rerendered(self, msgs: list[dict[str, Any]], tools: list[Any] | None, kept: Reply, end: int) -> bool:
        """Continue the segment with ``kept`` if the request gives the policy exactly the ids it has
        (the module docstring's rule); True when it did."""
        kwargs = {"tools": tools} if tools else {}
        sampled = self.current.context() + kept.forced + self.delta.written_ids(kept.completion.token_ids)
        whole = self.delta.prompt(msgs, **kwargs)
        if whole[:len(sampled)] == sampled and len(whole) > len(sampled):
            tail = whole[len(sampled):]
        elif end == len(self.known) + 1 and tools == self.tools and self._retokenises(msgs[:end], kept, kwargs):
            tail = self.delta.after_model_turn(kept.completion.token_ids, msgs[end:], **kwargs)
        else:
            return False
        self._continue_with(kept)
        self.rerendered_matched += 1
        # token-exact: its calls came back as the model wrote them, so the first message after answers them
        self.tries += _opens_try(msgs[end:], bool(kept.message.get("tool_calls")) and msgs[end]["role"] != "tool")
        self._check_room(len(self.current) + len(tail))
        self.current.add_observation(tail)
        self.known, self.tools = msgs, tools
        return True

    def _retokenises(self, msgs: list[dict[str, Any]], reply: Reply, kwargs: dict) -> bool:
        """Whether the last of ``msgs`` (an assistant message after the known ones) renders to text that
        encodes to exactly the ids the model wrote (its forced opening included)."""
        before = self.delta.render(msgs[:-1], add_generation_prompt=True, **kwargs)
        after = self.delta.render(msgs, **kwargs)
        eot = self.delta.end_of_turn
        if not after.startswith(before) or not after.endswith(eot):
            return False
        text = after[len(before):len(after) - len(eot)]
        return self.delta.encode(text) == reply.forced + self.delta.written_ids(reply.completion.token_ids)

    def room(self) -> int:
        """Tokens the current segment may still generate."""
        return self.max_total_tokens - (len(self.current) if self.current is not None else 0)

    def record(self, replies: list[Reply]) -> None:
        self.pending = list(replies)

    def finish(self) -> list[Trajectory]:
        """Seal the session: its segments with model tokens, oldest first."""
        self._seal()
        return self.segments

    def _check_room(self, length: int) -> None:
        if length >= self.max_total_tokens:
            raise RequestError(f"this session's context would be {length} tokens; its limit is "
                               f"{self.max_total_tokens} (prompt and replies together), leaving no room to reply",
                               code="context_length_exceeded", param="messages")

    def _continue_with(self, reply: Reply) -> None:
        if reply.forced:
            self.current.add_observation(reply.forced)
        self.current.add_model_turn(reply.completion)
        self.discarded_replies += len(self.pending) - 1
        self.pending = []

    def _seal(self, reply: Reply | None = None) -> None:
        """Close the current segment with ``reply`` (default: the first of the last request's) as its
        last turn."""
        if self.current is None:
            return
        if self.pending:
            self._continue_with(reply if reply is not None else self.pending[0])
        if any(self.current.policy_mask):
            self.segments.append(self.current)
        self.current, self.known, self.tools = None, [], None

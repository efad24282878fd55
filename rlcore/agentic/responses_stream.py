"""A streamed Responses reply (``stream=true`` on ``/v1/responses``): the events the stock ``openai``
client's ``responses.create(stream=True)`` and ``responses.stream(...)`` read.

Why a module of its own: the Responses stream is a state machine of items and parts (an item is
added, its content part is added, text deltas, the part and the item are done), longer than the
chat wire's chunks; ``responses_wire`` keeps the request and the non-streamed body. The text
comes as the engine samples it (``chat_stream.StreamedTurn`` drives this formatter), the calls
whole at the end, as on the other wires:

    response.created, response.in_progress
    response.output_item.added (message), response.content_part.added (output_text)
    response.output_text.delta ...
    response.output_text.done, response.content_part.done, response.output_item.done
    per call: response.output_item.added (function_call), response.function_call_arguments.delta,
              response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete, when max_output_tokens cut the reply), with usage

An error once the stream has started is an ``error`` event (code, message), as OpenAI sends it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from rlcore.agentic.responses_wire import (
    ResponsesRequest,
    call_item,
    message_item,
    response_object,
    text_part,
    usage,
)


class ResponsesStream:
    """The formatter of one streamed response (``chat_stream.StreamFormat``); ``done(choice, body)`` is
    called with the completed response, before its last event is sent."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest, done: Callable[[Any, dict], None]) -> None:
        self.rid, self.model, self.req, self.done = rid, model, req, done
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items done so far
        self.mid = f"msg_{uuid.uuid4().hex}"
        self.text_open, self.written = False, ""

    def _event(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def _response(self, status: str, choice: Any = None, prompt_tokens: int = 0) -> dict[str, Any]:
        return response_object(self.rid, self.model, self.req, status, list(self.output),
                               usage(prompt_tokens, choice) if choice is not None else None)

    def start(self) -> list[str]:
        response = self._response("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def text(self, index: int, text: str, logprobs: list[dict]) -> list[str]:
        events = []
        if not self.text_open:
            self.text_open = True
            at = {"item_id": self.mid, "output_index": len(self.output)}
            events += [self._event("response.output_item.added", output_index=len(self.output),
                                   item=message_item(self.mid, "", "in_progress")),
                       self._event("response.content_part.added", **at, content_index=0, part=text_part(""))]
        self.written += text
        return events + [self._event("response.output_text.delta", item_id=self.mid, output_index=len(self.output),
                                     content_index=0, delta=text, logprobs=list(logprobs))]

    def finish(self, index: int, rest: str, logprobs: list[dict], choice: Any) -> list[str]:
        calls = choice.reply.message.get("tool_calls") or []
        events = self.text(index, rest, logprobs) if rest or logprobs or not (calls or self.text_open) else []
        if self.text_open:
            at = {"item_id": self.mid, "output_index": len(self.output), "content_index": 0}
            item = message_item(self.mid, self.written, "incomplete" if choice.finish == "length" else "completed",
                                [e for _, e in choice.pieces if e is not None])
            events += [self._event("response.output_text.done", **at, text=self.written,
                                   logprobs=item["content"][0]["logprobs"]),
                       self._event("response.content_part.done", **at, part=item["content"][0]),
                       self._event("response.output_item.done", output_index=len(self.output), item=item)]
            self.output.append(item)
            self.text_open = False
        for call in calls:
            item, at = call_item(call), {"output_index": len(self.output)}
            events += [self._event("response.output_item.added", **at, item=call_item(call, "in_progress")),
                       self._event("response.function_call_arguments.delta", **at, item_id=item["id"],
                                   delta=item["arguments"]),
                       self._event("response.function_call_arguments.done", **at, item_id=item["id"],
                                   name=item["name"], arguments=item["arguments"]),
                       self._event("response.output_item.done", **at, item=item)]
            self.output.append(item)
        return events

    def end(self, prompt_tokens: int, choices: list[Any]) -> list[str]:
        [choice] = choices
        status = "incomplete" if choice.finish == "length" else "completed"
        response = self._response(status, choice, prompt_tokens)
        self.done(choice, response)
        return [self._event(f"response.{status}", response=response)]

    def error(self, message: str, kind: str, code: str) -> list[str]:
        return [self._event("error", code=code, message=message, param=None)]

"""A streamed reply's text as its tokens arrive: only text that is final, in order.

Why not decode each token alone: a character can span several tokens (byte-level BPE splits
"日" into three bytes), a token's text can depend on its neighbours (SentencePiece's leading
space), and the reply the agent finally gets is cut before the first stop string and has its
tool calls taken out. A streamed delta must never be taken back, so ``TextStream`` releases
text only once it is stable:

- decoded incrementally over a window (``prefix``..``read`` offsets, as vLLM's detokenizer does):
  the text of the tokens since the last release is compared with the same window one token
  shorter, and new text is released only when it does not end in an unfinished character (U+FFFD);
- never the part that may still become a stop string (the longest tail of the text that a stop
  string starts with is held; at a stop string the text ends);
- with tools offered, nothing from the first ``<tool_call>`` (or the tail that may start one) on:
  the calls come whole at the end, as the proxy parses them.

``finish(content)`` gives what is left of the final message content after what was released,
so the deltas add up to exactly the content the non-streamed reply has (when the released text
is not a prefix of it, which only tool-call stripping can cause, nothing more is sent).
"""

from __future__ import annotations

from collections.abc import Sequence

from rlcore.agentic.text_codec import TextCodec

TOOL_CALL_OPEN = "<tool_call>"
UNFINISHED = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stops: Sequence[str] = (), hold_tool_calls: bool = False) -> None:
        self.codec = TextCodec(tokenizer)  # a decode per token: without transformers' per-call overhead
        self.stops = tuple(s for s in stops if s)
        self.markers = self.stops + ((TOOL_CALL_OPEN,) if hold_tool_calls else ())
        self.ids: list[int] = []
        self.prefix = self.read = 0  # token offsets: the window's start, and the end of what is decoded
        self.text = ""  # the stable text of ids[:read]
        self.sent = ""  # what was released
        self.closed = False  # a stop string (or a tool call) was reached: nothing more streams

    def push(self, token_ids: Sequence[int]) -> str:
        """The text these tokens make releasable now ('' when none)."""
        self.ids += list(token_ids)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith(UNFINISHED) and after.startswith(before):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release()

    def finish(self, content: str | None) -> str:
        """The rest of the final ``content`` after the released text."""
        content = content or ""
        return content[len(self.sent):] if content.startswith(self.sent) else ""

    def _release(self) -> str:
        if self.closed:
            return ""
        limit = len(self.text)
        for marker in self.markers:
            at = self.text.find(marker)
            if at >= 0:
                limit, self.closed = min(limit, at), True
        if not self.closed:
            limit -= _held_tail(self.text, self.markers)
        new = self.text[len(self.sent):limit]
        self.sent += new
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids, skip_special_tokens=True) if ids else ""


def _held_tail(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that some marker starts with (it may still become one)."""
    held = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:n]):
                held = n
                break
    return held

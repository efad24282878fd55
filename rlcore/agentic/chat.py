"""Chat-template rendering for token-first episodes: the first prompt, then only each new turn's delta.

Why deltas: an episode's context is the exact ids the policy saw and sampled. Re-rendering the
whole conversation through the template each turn need not reproduce them: templates re-render
history (Qwen3 drops earlier ``<think>`` blocks), and decoding the model's tokens to text and
encoding them again need not give the same ids. So the history is never rendered again: after a
model turn, ``ChatDelta.after_model_turn`` renders just what the template puts between that turn
and the next generation (the end-of-turn text the model did not generate itself, the new user or
tool messages, the assistant cue), and the episode appends those ids to the ones it has.

How: the template is rendered once around a probe conversation (a user message, an assistant
reply), and the text that closes an assistant turn is read off it (``"\\n"`` for the tiny models'
template, ``"<|im_end|>\\n"`` for ChatML). A delta is the rendering of probe + new messages with
the probe's rendering cut off the front, prefixed by whatever part of the end-of-turn text the
model's own tokens lacked.

Who uses it: the built-in envs (``Env.render_prompt`` / ``Env.render_turn`` in ``rlcore.agentic.env``),
so both multi-turn paths (``MultiTurnRollout``, ``play_episode``) feed a chat model its own format,
and the chat proxy's sessions. For the tiny models' template the ids are those of the plain
``user: ...\nassistant: `` text the envs wrote before they rendered through the template.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlcore.agentic.text_codec import TextCodec

PROBE_USER = "\u2063probe\u2063"
PROBE_REPLY = "\u2063reply\u2063"
PROBE_TOOL = "probe_tool_\u2063"


class ChatDelta:
    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{type(tokenizer).__name__} has no chat template: ChatDelta renders chat turns through "
                             "it; set tokenizer.chat_template (rlcore.models.tiny.CHAT_TEMPLATE is a plain "
                             "'role: content' one)")
        self.tokenizer = tokenizer
        self.codec = TextCodec(tokenizer)
        probe = [{"role": "user", "content": PROBE_USER}]
        cue = self.render(probe, add_generation_prompt=True)
        with_reply = self.render(probe + [{"role": "assistant", "content": PROBE_REPLY}])
        if not with_reply.startswith(cue + PROBE_REPLY):
            raise ValueError("the chat template renders an assistant reply differently from the generation cue "
                             f"it gives: {cue!r} + reply vs {with_reply!r}; delta rendering needs the cue as a prefix")
        self._probe = probe + [{"role": "assistant", "content": PROBE_REPLY}]
        self._probe_text = with_reply
        self.end_of_turn = with_reply[len(cue) + len(PROBE_REPLY):]  # what closes an assistant turn

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False, **kwargs) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def prompt(self, messages: Sequence[Mapping[str, Any]], **kwargs) -> list[int]:
        """The first context: ``messages`` rendered whole, with the assistant cue."""
        return self.encode(self.render(messages, add_generation_prompt=True, **kwargs))

    def after_model_turn(self, model_token_ids: Sequence[int], new_messages: Sequence[Mapping[str, Any]],
                         add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """The ids to append after the model's turn: the rest of its end-of-turn text, then
        ``new_messages`` (user / tool) and, unless told otherwise, the next assistant cue."""
        # kwargs (tools=...) may change what the template writes before the first message: the
        # probe is rendered with the same ones, so only the new messages differ.
        probe_text = self.render(self._probe, **kwargs) if kwargs else self._probe_text
        full = self.render(self._probe + list(new_messages), add_generation_prompt=add_generation_prompt, **kwargs)
        if not full.startswith(probe_text):
            raise ValueError("the chat template re-renders the probe conversation when messages follow it; "
                             "delta rendering needs earlier turns to render the same")
        return self.encode(self._missing_end_of_turn(model_token_ids) + full[len(probe_text):])

    def tool_call_opening(self, tools: Sequence[Mapping[str, Any]], name: str | None = None) -> str | None:
        """The text the template starts an assistant tool call with, up to where the model writes the
        function's name (``name=None``), or with ``name`` written, up to its arguments: what a forced
        ``tool_choice`` puts at the start of the turn. None when the template renders no tool calls."""
        call = {"id": "call_probe", "type": "function", "function": {"name": PROBE_TOOL, "arguments": {}}}
        cue = self.render(self._probe[:1], add_generation_prompt=True, tools=list(tools))
        full = self.render(self._probe[:1] + [{"role": "assistant", "content": "", "tool_calls": [call]}],
                           tools=list(tools))
        at = full.find(PROBE_TOOL, len(cue))
        args = full.find("{}", at + len(PROBE_TOOL))  # the probe's empty arguments, after the name
        if not full.startswith(cue) or at < 0 or args < 0 or "{}" in full[len(cue):at]:
            return None  # no calls rendered, or not the name first: no opening to give
        if name is None:
            return full[len(cue):at]
        return full[len(cue):at] + name + full[at + len(PROBE_TOOL):args]

    def written_ids(self, model_token_ids: Sequence[int]) -> list[int]:
        """The model's ids as a rendering of its turn would hold them: without a closing eos the
        template does not write (the tiny models'); what a re-rendered history is compared with."""
        ids, eos = list(model_token_ids), self.tokenizer.eos_token
        if ids and ids[-1] == self.tokenizer.eos_token_id and eos and not self.end_of_turn.startswith(eos):
            ids.pop()
        return ids

    def close_turn(self, model_token_ids: Sequence[int]) -> list[int]:
        """The ids that close the model's turn and nothing more: the part of ``end_of_turn`` its
        tokens lack (``[]`` when it wrote all of it)."""
        return self.encode(self._missing_end_of_turn(model_token_ids))

    def _missing_end_of_turn(self, model_token_ids: Sequence[int]) -> str:
        """The part of ``end_of_turn`` the model's own text does not already end with."""
        text = self.codec.decode(model_token_ids, skip_special_tokens=False)
        eos = self.tokenizer.eos_token or ""
        if eos and text.endswith(eos) and not self.end_of_turn.startswith(eos):
            text = text[: -len(eos)]  # an eos the template does not write (the tiny models') closes nothing
        for overlap in range(min(len(text), len(self.end_of_turn)), 0, -1):
            if text.endswith(self.end_of_turn[:overlap]):
                return self.end_of_turn[overlap:]
        return self.end_of_turn

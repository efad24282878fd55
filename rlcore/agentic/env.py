"""Environments for agentic episodes: token ids in and out, asynchronous, one episode per instance.

Why token ids and not text: a trajectory that is decoded to text and tokenized again need not
give back the tokens the policy sampled (merges, whitespace, special tokens), and then the
log-probs the trainer recomputes describe a different sequence than the one the sampler scored.
So the env receives the model's tokens untouched (it may decode them to *read* them) and answers
with token ids it encoded itself with the policy's tokenizer; the episode only ever concatenates
ids.

Chat envs speak in messages, rendered through the tokenizer's chat template (so a Qwen-style model
gets its ``<|im_start|>`` turns, the tiny models their ``user: ...`` lines): ``render_prompt`` for the
first context, then ``render_turn`` after each model turn, which renders only that turn's delta
(``rlcore.agentic.chat.ChatDelta``): what closes the model's turn, the env's new messages and the
assistant cue. Earlier ids never change, even where the template would re-render history (Qwen3
drops the ``<think>`` blocks of earlier assistant turns), and the model's own ids stay as sampled.
A chat env on a tokenizer without a chat template fails at construction, naming the env.

Why asynchronous: a step may wait on a tool, a sandbox, a web request. ``await env.step(...)``
lets the episode's coroutine yield, and the engine serves the other episodes meanwhile.

Contract (a fresh instance per episode; Molt's Env/Result, token-first)::

    observation = await env.reset(task)       # the initial prompt, token ids; task: the dataset row
    result = await env.step(action_token_ids)  # Result(reward, observation, terminated, truncated, info)

``result.observation`` is what the env inserts before the model's next turn (a tool result, then
the cue for the assistant); after ``terminated`` or ``truncated`` nothing follows it. Rewards are
summed over the episode's turns. ``info`` holds scalar diagnostics (logged as means).

Latency: ``make_env(name, tokenizer, step_latency_s=m, latency_sigma=s, **kwargs)`` wraps any env so
that each step first sleeps a log-normal time of mean ``m`` (heavy-tailed for ``s`` around 1),
seeded by the task's ``seed``: the stand-in for tools that take time, in benchmarks and recipes.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from rlcore.agentic.chat import ChatDelta
from rlcore.agentic.text_codec import TextCodec
from rlcore.registry import Registry
from rlcore.rewards.registry import get_reward_fn

Observation = list[int]


@dataclass
class Result:
    """What one env step returns."""

    reward: float = 0.0
    observation: Observation = field(default_factory=list)  # token ids before the model's next turn
    terminated: bool = False  # the episode reached its end (solved, failed for good)
    truncated: bool = False  # the episode was cut short (a turn limit of the env's own)
    info: dict[str, float] = field(default_factory=dict)  # scalar diagnostics


class Env(ABC):
    """One episode per instance; encodes its own text with the policy's tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._chat: ChatDelta | None = None
        self._codec: TextCodec | None = None

    @property
    def chat(self) -> ChatDelta:
        """The tokenizer's chat template as deltas, built on first use; a chat env touches it in
        ``__init__`` so that a tokenizer without a template fails there."""
        if getattr(self, "_chat", None) is None:
            try:
                self._chat = ChatDelta(self.tokenizer)
            except ValueError as exc:
                raise ValueError(f"{type(self).__name__} renders its turns through the chat template: {exc}") from exc
        return self._chat

    def render_prompt(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> Observation:
        """The first context: ``messages`` through the chat template, with the assistant cue."""
        return self.chat.prompt(messages, **template_kwargs)

    def render_turn(self, action_token_ids: Sequence[int], messages: Sequence[Mapping[str, Any]],
                    **template_kwargs: Any) -> Observation:
        """What follows the model's turn ``action_token_ids``: the end-of-turn text it did not write,
        ``messages`` (user / tool) and the assistant cue, as the template renders them after a reply."""
        return self.chat.after_model_turn(action_token_ids, messages, **template_kwargs)

    @property
    def codec(self) -> TextCodec:
        """The tokenizer's encode / decode without transformers' per-call overhead (see text_codec)."""
        if getattr(self, "_codec", None) is None:  # an env whose __init__ skipped Env's
            self._codec = TextCodec(self.tokenizer)
        return self._codec

    def encode(self, text: str) -> Observation:
        """The env's text as token ids, no special tokens added (they are not the env's words)."""
        return self.codec.encode(text)

    def decode_action(self, action_token_ids: Sequence[int]) -> str:
        """Read the model's tokens (special tokens such as eos dropped); never re-encode this."""
        return self.codec.decode(action_token_ids, skip_special_tokens=True)

    @abstractmethod
    async def reset(self, task: Mapping[str, Any]) -> Observation: ...

    @abstractmethod
    async def step(self, action_token_ids: Sequence[int]) -> Result: ...


_ENVS: Registry[Callable[..., Env]] = Registry("env")
register_env = _ENVS.register  # decorator: make_env(name, tokenizer, **kwargs) builds the class


def make_env(name: str, tokenizer, step_latency_s: float = 0.0, latency_sigma: float = 1.0, **kwargs: Any) -> Env:
    """A fresh env: a registered name or ``package.module:Class``, built with ``kwargs``; with a
    simulated step latency when ``step_latency_s > 0`` (see the module docstring)."""
    env = _ENVS.get(name)(tokenizer, **kwargs)
    return LatencyEnv(env, step_latency_s, latency_sigma) if step_latency_s > 0 else env


class LatencyEnv(Env):
    """``env`` whose every step first sleeps a log-normal time of mean ``mean_s`` (sigma ``sigma`` of
    the log), drawn from a stream seeded by the task's ``seed``."""

    def __init__(self, env: Env, mean_s: float, sigma: float = 1.0) -> None:
        super().__init__(env.tokenizer)
        if mean_s <= 0 or sigma < 0:
            raise ValueError(f"step latency needs mean_s > 0 and sigma >= 0, got {mean_s}, {sigma}")
        self.env, self.mean_s, self.sigma = env, mean_s, sigma
        self.rng = random.Random(0)

    async def reset(self, task: Mapping[str, Any]) -> Observation:
        self.rng = random.Random(task.get("seed", 0))
        return await self.env.reset(task)

    def delay(self) -> float:
        # mean of lognormal(mu, sigma) is exp(mu + sigma^2 / 2): choose mu so that it is mean_s
        return self.rng.lognormvariate(math.log(self.mean_s) - self.sigma ** 2 / 2, self.sigma)

    async def step(self, action_token_ids: Sequence[int]) -> Result:
        await asyncio.sleep(self.delay())
        return await self.env.step(action_token_ids)


@register_env("guess_number")
class GuessNumberEnv(Env):
    """Guess a secret integer in [low, high]; the env answers "too high", "too low" or "correct".

    The episode ends on a correct guess (reward ``discount ** (turn - 1)``, so 1.0 on the first
    turn: finding it sooner is worth more) or after ``max_turns`` guesses (reward 0). An answer
    is read as the first integer in the decoded text; one with no integer gets "say a number"
    and uses up its turn. The secret is the task's ``target``, or else drawn from its ``seed``.

    The turns are user messages through the tokenizer's chat template. The final reply is no chat
    turn (nothing follows it, and neither episode path appends it): the rest of the model's
    end-of-turn and the verdict as plain text, for logs.
    """

    def __init__(self, tokenizer, low: int = 1, high: int = 100, max_turns: int = 6, discount: float = 0.9) -> None:
        super().__init__(tokenizer)
        if low > high:
            raise ValueError(f"guess_number needs low <= high, got low={low}, high={high}")
        if max_turns < 1:
            raise ValueError(f"guess_number needs max_turns >= 1, got {max_turns}")
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"guess_number discount must be in (0, 1], got {discount}")
        self.low, self.high, self.max_turns, self.discount = low, high, max_turns, discount
        self.target: int | None = None
        self.turn = 0
        self.done = True
        self.chat  # built now: a tokenizer without a chat template fails here, not mid-episode

    async def reset(self, task: Mapping[str, Any]) -> Observation:
        target = task.get("target")
        if target is None:
            target = random.Random(task.get("seed")).randint(self.low, self.high)
        if not self.low <= target <= self.high:
            raise ValueError(f"target {target} is outside [{self.low}, {self.high}]")
        self.target, self.turn, self.done = target, 0, False
        return self.render_prompt([{"role": "user", "content": f"guess my number from {self.low} to {self.high}."}])

    async def step(self, action_token_ids: Sequence[int]) -> Result:
        if self.done:
            raise RuntimeError("step() on a finished episode: call reset() first")
        self.turn += 1
        match = re.search(r"-?\d+", self.decode_action(action_token_ids))
        guess = int(match.group()) if match else None
        if guess == self.target:
            reply, reward, self.done = "correct", self.discount ** (self.turn - 1), True
        else:
            reply = "say a number" if guess is None else ("too high" if guess > self.target else "too low")
            reward, self.done = 0.0, self.turn >= self.max_turns
        if self.done:  # nothing follows a final observation: no chat turn, no assistant cue
            observation = self.chat.close_turn(action_token_ids) + self.encode(reply)
        else:
            observation = self.render_turn(action_token_ids, [{"role": "user", "content": reply}])
        return Result(reward, observation, terminated=self.done,
                      info={"guessed": float(guess is not None), "turn": float(self.turn)})


@register_env("arithmetic_retry")
class ArithmeticRetryEnv(Env):
    """A question with a known answer (the arithmetic task's ``a+b=``, or a word problem), answered in
    up to ``max_turns`` tries: a wrong answer gets the question again, a right one ends the episode with
    reward ``discount ** (turn - 1)`` (1.0 first time), no right answer by the last try gets 0.

    The prompt is the question as the single-turn recipes pose it, so a policy trained on them
    starts out sometimes right; the retries make the episode multi-turn, and the discount makes
    being right at once worth the most. An answer is the decoded text, stripped, compared exactly,
    or with ``check`` a reward function's name (``final_number``: a real chat model's "17 + 25 = 42"
    is right) that must score it 1.

    ``chat_template`` (like ``data.apply_chat_template``; default off, as the single-turn recipes'
    data): the question is a user message through the tokenizer's chat template and each retry a
    delta after the model's turn, instead of the raw text and ``"\n" + question``. A task whose data
    came as chat messages (its ``messages``) is asked as those messages, retried with its last user
    message, always through the template.
    """

    def __init__(self, tokenizer, max_turns: int = 3, discount: float = 0.5, chat_template: bool = False,
                 check: str | None = None) -> None:
        super().__init__(tokenizer)
        if max_turns < 1 or not 0.0 < discount <= 1.0:
            raise ValueError(f"arithmetic_retry needs max_turns >= 1 and discount in (0, 1], got {max_turns}, {discount}")
        self.max_turns, self.discount, self.chat_template = max_turns, discount, bool(chat_template)
        self.check = get_reward_fn(check) if check else None
        if self.chat_template:
            self.chat  # built now: a tokenizer without a chat template fails here
        self.question, self.answer, self.messages = "", "", []
        self.turn, self.done = 0, True

    async def reset(self, task: Mapping[str, Any]) -> Observation:
        prompt, answer = task.get("prompt"), task.get("answer")
        if not prompt or answer is None or str(answer).strip() == "":
            raise ValueError(f"arithmetic_retry needs a task with 'prompt' (the question) and 'answer', got {dict(task)}")
        self.question, self.answer, self.turn, self.done = prompt, str(answer).strip(), 0, False
        self.messages = [dict(m) for m in task.get("messages") or []]  # the data's own chat form, if any
        if self.messages:
            return self.render_prompt(self.messages)
        return self.render_prompt([self._ask()]) if self.chat_template else self.encode(prompt)

    def _ask(self) -> dict[str, str]:
        if self.messages:
            return next(m for m in reversed(self.messages) if m["role"] == "user")
        return {"role": "user", "content": self.question}

    def _right(self, text: str) -> bool:
        if self.check is not None:
            return float(self.check(text, self.answer)) == 1.0
        return text.strip() == self.answer

    async def step(self, action_token_ids: Sequence[int]) -> Result:
        if self.done:
            raise RuntimeError("step() on a finished episode: call reset() first")
        self.turn += 1
        right = self._right(self.decode_action(action_token_ids))
        reward = self.discount ** (self.turn - 1) if right else 0.0
        self.done = right or self.turn >= self.max_turns
        if self.done:
            observation = []
        elif self.chat_template or self.messages:
            observation = self.render_turn(action_token_ids, [self._ask()])
        else:
            observation = self.encode("\n" + self.question)
        return Result(reward, observation, terminated=self.done,
                      info={"right": float(right), "turn": float(self.turn)})

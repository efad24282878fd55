"""Environments for multi-turn rollouts, in token ids, plus a registry and one real game.

Why token ids and not text: a trajectory that is decoded to text and tokenized again need not
give back the tokens the policy sampled (merges, whitespace, special tokens), and then the
log-probs the trainer recomputes describe a different sequence than the one the sampler scored.
So the env receives the model's tokens untouched (it may decode them to *read* them) and answers
with token ids it encoded itself with its own tokenizer; the rollout only ever concatenates ids.

Contract (one episode per instance; ``reset`` starts a new one):

    reset(seed=None, **task) -> observation               the initial prompt, token ids
    step(action_token_ids)  -> (observation, reward, done, info)

``observation`` after a step is what the env inserts before the model's next turn (e.g. a tool
result followed by the cue for the assistant); when ``done`` it may be empty, nothing follows it.
"""

from __future__ import annotations

import random
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple

from rlcore.registry import Registry

Observation = list[int]


class StepResult(NamedTuple):
    observation: Observation
    reward: float
    done: bool
    info: dict[str, Any]


class Env(ABC):
    """One episode at a time; owns the tokenizer that encodes its own text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> Observation:
        """The env's text as token ids, no special tokens added (they are not the env's words)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_action(self, action_token_ids: Sequence[int]) -> str:
        """Read the model's tokens (special tokens such as eos dropped); never re-encode this."""
        return self.tokenizer.decode(list(action_token_ids), skip_special_tokens=True)

    @abstractmethod
    def reset(self, seed: int | None = None, **task: Any) -> Observation: ...

    @abstractmethod
    def step(self, action_token_ids: Sequence[int]) -> StepResult: ...


_ENVS: Registry[Callable[..., Env]] = Registry("env")
register_env = _ENVS.register  # decorator: make_env(name, tokenizer, **kwargs) builds the class


def make_env(name: str, tokenizer, **kwargs: Any) -> Env:
    return _ENVS.get(name)(tokenizer, **kwargs)


def user_turn(content: str) -> str:
    """One user message and the assistant cue, in the tiny models' chat format
    (``rlcore.models.tiny.CHAT_TEMPLATE``)."""
    return f"user: {content}\nassistant: "


@register_env("guess_number")
class GuessNumberEnv(Env):
    """Guess a secret integer in [low, high]; the env answers "too high", "too low" or "correct".

    The episode ends on a correct guess (reward ``discount ** (turn - 1)``, so 1.0 on the first
    turn: finding it sooner is worth more) or after ``max_turns`` guesses (reward 0). An answer
    is read as the first integer in the decoded text; one with no integer gets "say a number"
    and uses up its turn. The secret comes from ``reset(target=...)`` or else from ``seed``.
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

    def reset(self, seed: int | None = None, target: int | None = None) -> Observation:
        if target is None:
            target = random.Random(seed).randint(self.low, self.high)
        if not self.low <= target <= self.high:
            raise ValueError(f"target {target} is outside [{self.low}, {self.high}]")
        self.target, self.turn, self.done = target, 0, False
        return self.encode(user_turn(f"guess my number from {self.low} to {self.high}."))

    def step(self, action_token_ids: Sequence[int]) -> StepResult:
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
        # Nothing follows a final observation, so it carries no assistant cue.
        text = "\n" + (reply if self.done else user_turn(reply))
        return StepResult(self.encode(text), reward, self.done, {"guess": guess, "turn": self.turn})


@register_env("arithmetic_retry")
class ArithmeticRetryEnv(Env):
    """A question with a known answer (the arithmetic task's ``a+b=``), answered in up to
    ``max_turns`` tries: a wrong answer gets the question again, a right one ends the episode with
    reward ``discount ** (turn - 1)`` (1.0 first time), no right answer by the last try gets 0.

    The prompt is the raw question, as the single-turn recipes pose it, so a policy trained on them
    starts out sometimes right; the retries make the episode multi-turn, and the discount makes
    being right at once worth the most. An answer is the decoded text, stripped, compared exactly.
    """

    def __init__(self, tokenizer, max_turns: int = 3, discount: float = 0.5) -> None:
        super().__init__(tokenizer)
        if max_turns < 1 or not 0.0 < discount <= 1.0:
            raise ValueError(f"arithmetic_retry needs max_turns >= 1 and discount in (0, 1], got {max_turns}, {discount}")
        self.max_turns, self.discount = max_turns, discount
        self.question = self.answer = ""
        self.turn, self.done = 0, True

    def reset(self, seed: int | None = None, prompt: str = "", answer: str = "") -> Observation:
        if not prompt or not answer:
            raise ValueError("arithmetic_retry.reset needs prompt= (the question) and answer=")
        self.question, self.answer, self.turn, self.done = prompt, str(answer).strip(), 0, False
        return self.encode(prompt)

    def step(self, action_token_ids: Sequence[int]) -> StepResult:
        if self.done:
            raise RuntimeError("step() on a finished episode: call reset() first")
        self.turn += 1
        right = self.decode_action(action_token_ids).strip() == self.answer
        reward = self.discount ** (self.turn - 1) if right else 0.0
        self.done = right or self.turn >= self.max_turns
        return StepResult([] if self.done else self.encode("\n" + self.question), reward, self.done,
                          {"right": right, "turn": self.turn})

"""`math_verify`: MATH-style answers judged by Hugging Face's `math-verify`, within a time budget.

The exact checker (`math`, rlcore.rewards.math_answers) compares numbers and normalised text, so it
cannot tell that `\\frac{1}{\\sqrt{2}}` is `\\frac{\\sqrt2}{2}`, that `\\{3,2,1\\}` is `\\{1,2,3\\}`, or
that `(x+1)^2` is `x^2+2x+1`. math-verify parses both sides into SymPy objects (numbers, expressions,
intervals, sets, matrices, equations) and compares those. It stays an option
(`reward.reward_fn=math_verify`, `pip install 'rlcore[math]'`): `math` is the default, and this grader
only runs math-verify where `math` says wrong. The answer is read the way `math` reads it (the last
`\\boxed{}`, else `<answer>`, else an "Answer:" line), so both demand the same format and a response
scores at least what it scores under `math`.

Symbolic comparison can explode (`9^{9^{9^{9}}}` against `3` never finishes), so every grading gets
`budget_s` seconds of wall time, then scores 0 with `.reason` "timeout ...". math-verify's own time
limits are `signal.alarm` calls (whole seconds, and each one cancels the timer set around it), so
they are switched off and this module sets one SIGALRM interval timer around the whole grading
instead: it re-fires every 50 ms, so code that swallows the first interruption gets another one. Only
a process's main thread may set signal handlers, which is why the function is marked
`needs_process`: the reward manager then runs it in its forked workers (in a fork, the forking
thread is the child's main thread), where the manager's `timeout_s` also kills a grading stuck in C
code that no signal can interrupt. Keep `budget_s` below `reward.timeout_s` (10 s by default), or a
slow row fails the whole call instead of scoring 0. Called directly off the main thread the grading
runs without a budget (there is no way to set one there).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rlcore.rewards.math_answers import answers_equal, extract_boxed, extract_math_answer

REFIRE_S = 0.05  # the timer's interval after the first expiry


class MathScore(float):
    """A `math_verify` score: a float, as reward functions return, that also says why (`reason`)."""

    def __new__(cls, score: float, reason: str) -> "MathScore":
        self = super().__new__(cls, score)
        self.reason = reason
        return self

    def __reduce__(self):
        return MathScore, (float(self), self.reason)

    def __repr__(self) -> str:
        return f"MathScore({float(self)!r}, reason={self.reason!r})"


class GradingTimeout(BaseException):
    """Raised by the timer; a BaseException so that the `except Exception` of math-verify and SymPy
    does not swallow it."""


class _DropTimeoutWarnings(logging.Filter):
    """math-verify warns once per process that its own timeouts are off: here they are replaced."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def _math_verify() -> Any:
    try:
        import math_verify  # optional dependency: the `math` extra
    except ImportError as exc:
        raise ImportError("reward function 'math_verify' needs the math-verify package: "
                          "pip install 'rlcore[math]' (or pip install math-verify)") from exc
    for name in ("math_verify.parser", "math_verify.grader"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropTimeoutWarnings) for f in log.filters):
            log.addFilter(_DropTimeoutWarnings())
    return math_verify


def _on_alarm(signum: int, frame: Any) -> None:
    raise GradingTimeout


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise `GradingTimeout` in this thread after `seconds` of wall time (and every 50 ms after that
    until the block ends). Off the main thread, or with `seconds=None`, it sets nothing. A timer that
    was already running (pytest-timeout's, say) is put back with its remaining time."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    if seconds <= 0:
        raise ValueError(f"math_verify budget_s must be > 0 seconds, got {seconds}")
    start = time.monotonic()
    previous_handler = signal.signal(signal.SIGALRM, _on_alarm)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, seconds, REFIRE_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:
            left = max(previous_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, previous_interval)


def math_verify_reward(response: str, ground_truth: Any, *, budget_s: float | None = 5.0,
                       format_score: float = 0.0, **extra) -> MathScore:
    """1.0 when the response's final answer equals the ground truth, exactly (as `math` decides) or by
    math-verify's symbolic comparison; `format_score` for a wrong answer in the right form; 0.0 for
    none, and 0.0 with reason "timeout ..." when grading takes over `budget_s` seconds."""
    answer = extract_math_answer(response)
    if answer is None:
        return MathScore(0.0, "no final answer (\\boxed{}, <answer> or 'Answer:')")
    truth = str(ground_truth)
    truth = extract_boxed(truth) or truth
    if answers_equal(answer, truth):
        return MathScore(1.0, "equal (exact)")
    math_verify = _math_verify()
    try:
        with time_limit(budget_s):
            gold = math_verify.parse(f"\\boxed{{{truth}}}", parsing_timeout=None)
            predicted = math_verify.parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
            same = bool(gold) and bool(predicted) and math_verify.verify(gold, predicted, timeout_seconds=None)
    except GradingTimeout:
        return MathScore(0.0, f"timeout: grading took over budget_s={budget_s:g}s")
    if same:
        return MathScore(1.0, "equal (math-verify)")
    return MathScore(format_score, "not equal")


def prepare() -> None:
    """Import math-verify and parse once, in the process that will fork the reward workers: each fork
    then starts warm (importing SymPy and the LaTeX parser takes about a second), and a missing
    package is an error when the manager is built, not on the first batch."""
    _math_verify().parse("\\boxed{1}", parsing_timeout=None)


math_verify_reward.needs_process = True  # its time limit is a signal: the manager runs it in forked workers
math_verify_reward.prepare = prepare  # the manager calls it once, when it resolves the function

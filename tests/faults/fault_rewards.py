"""Reward functions for the fault tests, loaded by path (reward.reward_fn=<this file>:<name>), so each
run gets a fresh module and its own call counter."""

import time
from pathlib import Path

CALLS = 0


def text_score(response: str, ground_truth: str, **_) -> float:
    """A deterministic score that differs between prompts' greedy answers, so advantages are not all 0."""
    return (sum(map(ord, response)) % 7) / 7


def hangs_on_third_row(response: str, ground_truth: str, started: str = "", **_) -> float:
    """Scores rows 0 and 1, then never returns (row 2); ``started`` names a file that gets the time the hang began."""
    global CALLS
    CALLS += 1
    if CALLS == 3:
        if started:
            Path(started).write_text(repr(time.time()))
        time.sleep(3600)
    return 0.5


def raises_on_second_row(response: str, ground_truth: str, **_) -> float:
    global CALLS
    CALLS += 1
    if CALLS == 2:
        raise ValueError(f"cannot score {response!r}")
    return 0.5

"""Rewards for recipe tests whose random-model samples must score apart: the response length, and a
score of the response's characters (so that greedy answers that change score differently)."""


def reward_by_length(response: str, ground_truth: str, **_) -> float:
    return float(len(response))


def reward_by_characters(response: str, ground_truth: str, **_) -> float:
    return float(sum(map(ord, response)) % 10)

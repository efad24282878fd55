"""A reward for the inspector's browser tests: the share of digits in the response, so that a random
model's samples of one prompt score apart (non-zero advantages, a reward range to filter on)."""


def digit_share(response: str, ground_truth: str, **_) -> float:
    return sum(c.isdigit() for c in response) / max(len(response), 1)

"""A reward for recipe tests: the response length (so samples of a random model differ in score)."""


def reward_by_length(response: str, ground_truth: str, **_) -> float:
    return float(len(response))

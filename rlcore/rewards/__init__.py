"""Rule-based rewards: answer extraction and comparison, and reward functions by name."""

from rlcore.rewards.math_answers import (
    answers_equal,
    extract_answer_tag,
    extract_boxed,
    extract_gsm8k_answer,
    extract_last_number,
    normalize_answer,
)
from rlcore.rewards.registry import RewardFn, get_reward_fn, register_reward_fn

__all__ = [
    "RewardFn",
    "answers_equal",
    "extract_answer_tag",
    "extract_boxed",
    "extract_gsm8k_answer",
    "extract_last_number",
    "get_reward_fn",
    "normalize_answer",
    "register_reward_fn",
]

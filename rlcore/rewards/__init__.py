"""Rule-based rewards: answer extraction and comparison, reward functions by name, and the manager
that scores a rollout batch with them (in forked processes, with a timeout)."""

from rlcore.rewards.manager import RewardConfig, RewardError, RuleRewardManager, reward_metrics
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
    "RewardConfig",
    "RewardError",
    "RewardFn",
    "RuleRewardManager",
    "reward_metrics",
    "answers_equal",
    "extract_answer_tag",
    "extract_boxed",
    "extract_gsm8k_answer",
    "extract_last_number",
    "get_reward_fn",
    "normalize_answer",
    "register_reward_fn",
]

"""Reward functions keyed by the dataset's `data_source`."""

from offbeat.core.rewards.registry import (
    BY_DATA_SOURCE,
    RewardError,
    RewardFn,
    RewardRegistry,
    load_reward_fn,
    register_reward,
    registered_rewards,
)
from offbeat.core.rewards.scorers import char_match, exact_match, extract_answer, math_answer

__all__ = [  # registry and built-in scorers
    "BY_DATA_SOURCE",
    "RewardError",
    "RewardFn",
    "RewardRegistry",
    "char_match",
    "exact_match",
    "extract_answer",
    "load_reward_fn",
    "math_answer",
    "register_reward",
    "registered_rewards",
]

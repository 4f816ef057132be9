"""Reward functions keyed by the dataset's `data_source`."""

from offbeat.core.rewards import checks as _checks  # noqa: F401  (registers the config rules)
from offbeat.core.rewards import genrm as _genrm  # noqa: F401  (registers `genrm`)
from offbeat.core.rewards.latex import answers_match, as_number, last_boxed, normalize_answer
from offbeat.core.rewards.math_datasets import (
    GSM8K_SOURCES,
    MATH_SOURCES,
    gsm8k_answer,
    gsm8k_extract,
    math_boxed_answer,
)
from offbeat.core.rewards.registry import (
    BY_DATA_SOURCE,
    RewardError,
    RewardFn,
    RewardRegistry,
    call_reward_fn,
    load_reward_fn,
    register_reward,
    registered_rewards,
    reward_registry,
)
from offbeat.core.rewards.scorers import char_match, exact_match, extract_answer, math_answer

__all__ = [  # noqa: RUF022 (grouped by concept)
    # registry
    "BY_DATA_SOURCE",
    "RewardError",
    "RewardFn",
    "RewardRegistry",
    "call_reward_fn",
    "load_reward_fn",
    "register_reward",
    "registered_rewards",
    "reward_registry",
    # built-in scorers
    "char_match",
    "exact_match",
    "extract_answer",
    "math_answer",
    # verl's data_source names: GSM8K and the MATH sets
    "GSM8K_SOURCES",
    "MATH_SOURCES",
    "gsm8k_answer",
    "gsm8k_extract",
    "math_boxed_answer",
    # LaTeX answers
    "answers_match",
    "as_number",
    "last_boxed",
    "normalize_answer",
]

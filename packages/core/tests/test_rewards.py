"""Reward registry: built-in scorers, user functions by import path, errors contained."""

from __future__ import annotations

import math

import pytest

from offbeat.core.registry import REWARD_FUNCTIONS
from offbeat.core.rewards import (
    RewardError,
    RewardRegistry,
    char_match,
    exact_match,
    extract_answer,
    load_reward_fn,
    math_answer,
    register_reward,
    registered_rewards,
)


def test_builtins_are_registered_in_core_registry():
    assert {"exact_match", "math", "char_match", "task"} <= set(registered_rewards())
    assert {"task", "math"} <= set(REWARD_FUNCTIONS.names())


def test_fixed_name_scores_every_row_and_kwargs_pass_through():
    reg = RewardRegistry(name="exact_match")
    assert reg.score("anything", "a", "a") == 1.0
    reg = RewardRegistry({"mine": f"{__name__}:user_reward"}, kwargs={"bonus": 10})
    assert reg.score("mine", "ab", None) == 12.0


@pytest.mark.parametrize(
    "response, truth, want",
    [("42", "42", 1.0), ("  Hello  World ", "hello world", 1.0), ("42.", "42", 0.0)],
)
def test_exact_match(response, truth, want):
    assert exact_match(response, truth) == want


@pytest.mark.parametrize(
    "response, truth, want",
    [
        ("so the answer is \\boxed{1/2}", "0.5", 1.0),
        ("work... #### 17", "17", 1.0),
        ("3 + 4 = 7", "7", 1.0),
        ("3 + 4 = 8", "7", 0.0),
        ("no digits here", "7", 0.0),
        ("1,000", "1000", 1.0),
    ],
)
def test_math_answer(response, truth, want):
    assert math_answer(response, truth) == want


def test_extract_answer_prefers_boxed_then_hashes_then_last_number():
    assert extract_answer("1 \\boxed{2} #### 3 4") == "2"
    assert extract_answer("1 #### 3 4") == "3 4"
    assert extract_answer("1 and 4") == "4"


def test_char_match_partial_credit():
    assert char_match("cba", "cba") == 1.0
    assert char_match("cbx", "cba") == pytest.approx(2 / 3)
    assert char_match("cbaaaa", "cba") == pytest.approx(0.5)
    assert char_match("", "cba") == 0.0


def user_reward(response, ground_truth, **extra):
    return len(response) + extra.get("bonus", 0)


def broken_reward(response, ground_truth, **extra):
    return 1 / 0


def test_user_function_by_import_path_and_errors_contained():
    reg = RewardRegistry({"mine": f"{__name__}:user_reward", "bad": f"{__name__}:broken_reward"})
    assert reg.score("mine", "abc", None, {"bonus": 2}) == 5.0
    assert reg.score("exact_match", "a", "a") == 1.0
    with pytest.raises(RewardError, match="ZeroDivisionError"):
        reg.score("bad", "x", "y")
    with pytest.raises(RewardError, match=r"registered: .*exact_match"):
        reg.score("nope", "x", "y")


def test_nan_reward_is_an_error():
    register_reward("nan_source", lambda r, g, **_: math.nan)
    with pytest.raises(RewardError, match="NaN"):
        RewardRegistry().score("nan_source", "x", "y")


@pytest.mark.parametrize(
    "path, match",
    [("no_colon", "pkg.module:function"), ("nonexistent_mod_xyz:f", "cannot import"),
     ("math:not_there", "no callable")],
)  # fmt: skip
def test_bad_import_paths_are_clear(path, match):
    with pytest.raises(ValueError, match=match):
        load_reward_fn(path)

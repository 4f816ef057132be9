"""Reward registry: built-in scorers, user functions by import path or file, both calling
conventions (offbeat's and verl's), errors contained."""

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
    return len(response) + extra.get("bonus", 0) + extra.get("extra_info", {}).get("bonus", 0)


def broken_reward(response, ground_truth, **extra):
    return 1 / 0


def test_user_function_by_import_path_and_errors_contained():
    reg = RewardRegistry({"mine": f"{__name__}:user_reward", "bad": f"{__name__}:broken_reward"})
    assert reg.score("mine", "abc", None, {"bonus": 2}) == 5.0  # extra_info reaches it
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
     ("math:not_there", "no callable"), ("/no/such/file.py:f", "FileNotFoundError")],
)  # fmt: skip
def test_bad_import_paths_are_clear(path, match):
    with pytest.raises(ValueError, match=match):
        load_reward_fn(path)


def test_math_scorer_reads_nested_boxes_and_latex():
    assert math_answer("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_answer("\\boxed{\\dfrac{3}{4}}", "\\frac34") == 1.0
    assert extract_answer("\\boxed{\\sqrt{\\frac{1}{2}}} end") == "\\sqrt{\\frac{1}{2}}"


# ---- calling conventions -----------------------------------------------------------------
def fixed_signature(response, ground_truth):
    return float(response == ground_truth)


def wants_row_fields(response, ground_truth, data_source, extra_info=None, scale=1.0):
    return scale * (data_source == "src") * extra_info["weight"]


def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "acc": True, "src": data_source}


def verl_style_no_extra(data_source, solution_str, ground_truth):
    return float(data_source == "src" and solution_str == ground_truth)


def test_each_signature_gets_the_row_fields_it_accepts():
    reg = RewardRegistry(
        {
            "src": f"{__name__}:wants_row_fields",
            "fixed": f"{__name__}:fixed_signature",
            "verl": f"{__name__}:verl_style",
        },
        kwargs={"scale": 2.0},
    )
    assert reg.score("src", "x", "y", {"weight": 0.25}) == 0.5  # data_source, extra_info, kwargs
    reg.kwargs = {}
    assert reg.score("fixed", "a", "a", {"weight": 1}) == 1.0  # takes neither: none passed
    assert reg.score("verl", "a", "a", {"index": 3}) == 1.0  # a dict result: its "score"
    assert reg.score("verl", "a", "b") == 0.0


def test_verl_signature_without_extra_info_is_called_without_it():
    reg = RewardRegistry({"src": f"{__name__}:verl_style_no_extra"})
    assert reg.score("src", "7", "7", {"index": 1}) == 1.0


def test_unknown_reward_kwarg_is_an_error_not_ignored():
    reg = RewardRegistry({"fixed": f"{__name__}:fixed_signature"}, kwargs={"typo": 1})
    with pytest.raises(RewardError, match="typo"):
        reg.score("fixed", "a", "a")


def test_user_function_from_a_file_path(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if solution_str.strip() == ground_truth else 0.0\n"
    )
    reg = RewardRegistry({"custom": f"{f}:compute_score"})
    assert reg.score("custom", " 42 ", "42") == 1.0
    assert load_reward_fn(f"{f}:compute_score") is load_reward_fn(f"{f}:compute_score")


def test_a_module_that_raises_on_import_is_a_clear_error(tmp_path):
    f = tmp_path / "broken_reward_mod.py"
    f.write_text("raise RuntimeError('needs an API key')\n")
    with pytest.raises(ValueError, match="RuntimeError: needs an API key"):
        load_reward_fn(f"{f}:fn")

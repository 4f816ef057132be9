"""The GSM8K and MATH scorers under verl's data_source names, and the LaTeX answer rules
they rest on, on responses shaped like real model outputs."""

from __future__ import annotations

import pytest

from offbeat.core.registry import REWARD_FUNCTIONS
from offbeat.core.rewards import (
    GSM8K_SOURCES,
    MATH_SOURCES,
    RewardRegistry,
    answers_match,
    gsm8k_answer,
    gsm8k_extract,
    last_boxed,
    math_boxed_answer,
    normalize_answer,
)

GSM8K_RESPONSE = (
    "Natalia sold 48/2 = 24 clips in May.\n"
    "Natalia sold 48 + 24 = 72 clips altogether in April and May.\n"
    "#### 72"
)
MATH_RESPONSE = (
    "We combine the fractions over a common denominator: "
    "$\\frac{1}{2} + \\frac{1}{3} = \\frac{3}{6} + \\frac{2}{6} = \\frac{5}{6}$.\n"
    "The final answer is $\\boxed{\\frac{5}{6}}$."
)


def test_verl_data_source_names_are_registered():
    assert "openai/gsm8k" in GSM8K_SOURCES
    assert {
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
    } <= set(MATH_SOURCES)
    for name in GSM8K_SOURCES:
        assert REWARD_FUNCTIONS.get(name) is gsm8k_answer
    for name in MATH_SOURCES:
        assert REWARD_FUNCTIONS.get(name) is math_boxed_answer


# ---- GSM8K ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "response, truth, want",
    [
        (GSM8K_RESPONSE, "72", 1.0),
        (GSM8K_RESPONSE, "73", 0.0),
        ("The total is 1,000 dollars.\n#### 1,000", "1000", 1.0),
        ("She pays $18.\n#### $18", "18", 1.0),
        ("#### 12.50", "12.5", 1.0),
        ("Temperature drops to -3.\n#### -3", "-3", 1.0),
        ("#### 5 then I changed my mind\n#### 7", "7", 1.0),  # the last one counts
        ("The answer is 72.", "72", 0.0),  # strict: no "####"
        ("#### 72", "He sold 48 + 24 = 72\n#### 72", 1.0),  # a raw GSM8K answer as truth
    ],
)
def test_gsm8k_strict(response, truth, want):
    assert gsm8k_answer(response, truth) == want


def test_gsm8k_flexible_takes_the_last_number():
    assert gsm8k_extract("The answer is 72.", method="flexible") == "72"
    assert gsm8k_answer("so she has 1,200 left.", "1200", method="flexible") == 1.0
    assert gsm8k_extract("no numbers at all.", method="flexible") is None
    with pytest.raises(ValueError, match="strict"):
        gsm8k_extract("#### 1", method="loose")


def test_gsm8k_format_score_and_tail_only():
    assert gsm8k_answer("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_answer("no answer", "72", format_score=0.1) == 0.0
    # as in verl, only the last 300 characters are searched
    assert gsm8k_answer("#### 72" + " blah" * 80, "72") == 0.0


def test_gsm8k_through_the_registry_with_verl_row_fields():
    reg = RewardRegistry()
    extra = {"split": "test", "index": 0, "answer": "...", "question": "..."}
    assert reg.score("openai/gsm8k", GSM8K_RESPONSE, "72", extra) == 1.0


# ---- MATH ----------------------------------------------------------------------------------
def test_last_boxed_handles_nested_braces():
    assert last_boxed(MATH_RESPONSE) == "\\frac{5}{6}"
    assert last_boxed("\\boxed{\\frac{\\sqrt{3}}{2}}") == "\\frac{\\sqrt{3}}{2}"
    assert last_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"  # escaped braces are literal
    assert last_boxed("first \\boxed{1}, finally \\boxed{2}") == "2"
    assert last_boxed("\\boxed 7$") == "7"
    assert last_boxed("\\fbox{3}") == "3"
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2") is None  # truncated
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    "answer, canonical",
    [
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\tfrac12", "\\frac{1}{2}"),
        ("\\frac1{2}", "\\frac{1}{2}"),
        ("1/2", "\\frac{1}{2}"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("90^\\circ", "90"),
        ("90^{\\circ}", "90"),
        ("\\$18.90", "18.90"),
        ("50\\%", "50"),
        ("12 \\text{ cm}^2", "12"),
        ("5 \\mbox{ units}", "5"),
        ("10 dollars", "10"),
        ("x = 5", "5"),
        ("\\text{(C)}", "(C)"),
        ("1,000", "1000"),
        (".5", "0.5"),
        ("\\sqrt3", "\\sqrt{3}"),
        ("3\\!\\cdot\\!4", "3\\cdot4"),
        ("5.", "5"),
        ("\\boxed{4}", "4"),
    ],
)
def test_normalize_answer(answer, canonical):
    assert normalize_answer(answer) == canonical


@pytest.mark.parametrize(
    "predicted, truth, want",
    [
        ("\\frac{5}{6}", "\\frac{5}{6}", True),
        ("\\dfrac{5}{6}", "\\frac56", True),
        ("0.5", "\\frac{1}{2}", True),
        ("-\\frac{1}{2}", "-0.5", True),
        ("120^\\circ", "120", True),
        ("6", "x=6", True),
        ("\\left[ 2, 5 \\right)", "[2,5)", True),
        ("\\frac{5}{6}", "\\frac{6}{5}", False),
        ("2\\sqrt{2}", "\\sqrt{8}", False),  # equivalent expressions are not recognised
        ("", "", False),
    ],
)
def test_answers_match(predicted, truth, want):
    assert answers_match(predicted, truth) is want


@pytest.mark.parametrize("source", MATH_SOURCES)
def test_math_sources_score_boxed_answers(source):
    reg = RewardRegistry()
    assert reg.score(source, MATH_RESPONSE, "\\frac{5}{6}", {"split": "test", "index": 3}) == 1.0
    assert reg.score(source, MATH_RESPONSE, "\\frac{1}{6}") == 0.0
    # the answer must be boxed: a bare final number is not read
    assert reg.score(source, "The answer is 5/6.", "\\frac{5}{6}") == 0.0


def test_math_truth_given_as_a_full_solution():
    truth = "Adding, $\\frac{3}{6}+\\frac{2}{6}=\\boxed{\\frac{5}{6}}$."
    assert math_boxed_answer(MATH_RESPONSE, truth) == 1.0

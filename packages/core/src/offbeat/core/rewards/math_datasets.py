"""Rule scorers for public math datasets, registered under the `data_source` names that
verl's preprocessing scripts write, so verl-format parquet files score unchanged.

Know nothing about where responses come from. Scores are `score` (default 1.0) for a
correct final answer and 0.0 otherwise (GSM8K: `format_score`, default 0.0, for an answer
in the right format that is wrong). Extra keyword arguments (reward.kwargs, the row's
`data_source` and `extra_info`) are accepted and ignored.

- GSM8K (`openai/gsm8k`): the answer is the last `#### <number>` in the response (verl's
  strict extraction; `method="flexible"` takes the last number instead). As in verl, only
  the response's last 300 characters are searched. Numbers compare exactly, ignoring `,`,
  `$` and trailing zeros (`#### 1,000.0` matches `1000`).
- MATH (`lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`,
  and the NuminaMath subsets `numina_*`): the answer is the last `\\boxed{...}`,
  compared with the ground truth after LaTeX normalisation (offbeat.core.rewards.latex).
  verl scores the NuminaMath subsets with its `prime_math` checker (sympy equivalence);
  this one is the string/number rule, stricter on equivalent expressions.
"""

from __future__ import annotations

import re
from typing import Any

from offbeat.core.rewards.latex import answers_match, as_number, last_boxed
from offbeat.core.rewards.registry import register_reward

__all__ = [
    "GSM8K_SOURCES",
    "MATH_SOURCES",
    "gsm8k_answer",
    "gsm8k_extract",
    "math_boxed_answer",
]

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
)

_CLIP_CHARS = 300  # verl searches only the tail: the answer is expected at the end
_STRICT = re.compile(r"####\s*\$?\s*(-?[0-9.,]+)")
_FLEXIBLE = re.compile(r"-?[0-9.,]+")


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").rstrip(".")


def gsm8k_extract(response: str, method: str = "strict") -> str | None:
    """The final answer of a GSM8K response: the number after the last `####`
    (`strict`), or the last number anywhere (`flexible`); None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method={method!r}: expected 'strict' or 'flexible'")
    tail = str(response)[-_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return _clean_number(found[-1]) if found else None
    for candidate in reversed(_FLEXIBLE.findall(tail)):
        if (number := _clean_number(candidate)) not in ("", "-"):
            return number
    return None


def _gsm8k_truth(ground_truth: Any) -> str:
    truth = str(ground_truth)
    if "####" in truth:  # a raw GSM8K answer (worked solution + "#### 72")
        truth = gsm8k_extract(truth) or truth
    return _clean_number(truth.strip())


def gsm8k_answer(
    response: str,
    ground_truth: Any,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    **_: Any,
) -> float:
    """`score` when the extracted answer equals the ground truth, `format_score` when an
    answer was found but is wrong, 0.0 when none was found."""
    answer = gsm8k_extract(response, method)
    if answer is None:
        return 0.0
    truth = _gsm8k_truth(ground_truth)
    a, b = as_number(answer), as_number(truth)
    correct = a == b if a is not None and b is not None else answer == truth
    return score if correct else format_score


def math_boxed_answer(response: str, ground_truth: Any, *, score: float = 1.0, **_: Any) -> float:
    """`score` when the last `\\boxed{...}` of the response matches the ground truth
    (itself a bare answer or a solution with a box) after normalisation, else 0.0."""
    answer = last_boxed(str(response))
    if answer is None:
        return 0.0
    return score if answers_match(answer, str(ground_truth)) else 0.0


for _name in GSM8K_SOURCES:
    register_reward(_name, gsm8k_answer)
for _name in MATH_SOURCES:
    register_reward(_name, math_boxed_answer)

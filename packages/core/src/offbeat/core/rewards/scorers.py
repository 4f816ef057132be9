"""Built-in rule-based scorers: exact match, math answers, character match.

Know nothing about where responses come from. Scores are 1.0 (correct) or 0.0, except
`char_match`'s partial credit. The scorers for public datasets under verl's data_source
names are in `math_datasets`.
"""

from __future__ import annotations

import re
from typing import Any

from offbeat.core.rewards.latex import answers_match, last_boxed
from offbeat.core.rewards.registry import BY_DATA_SOURCE, RewardError, register_reward

_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?")


def _normalise(text: str) -> str:
    return " ".join(str(text).strip().split()).lower()


@register_reward("exact_match")
def exact_match(response: str, ground_truth: Any, **_: Any) -> float:
    """1.0 when the response equals the ground truth up to surrounding/internal
    whitespace and case."""
    return float(_normalise(response) == _normalise(ground_truth))


# The synthetic visual task's rows where tasks are mixed (offbeat.core.tasks.visual):
# its own data_source, so an OPD job routes them to a teacher of their own.
register_reward("shapes", exact_match)


def extract_answer(response: str) -> str | None:
    """The final answer in a math response: `\\boxed{...}`, else after `####`, else the
    last number in the text."""
    if (boxed := last_boxed(response)) is not None:
        return boxed
    if m := _HASHES.findall(response):
        return m[-1].strip()
    if m := _NUMBER.findall(response):
        return m[-1]
    return None


@register_reward("math")
def math_answer(response: str, ground_truth: Any, **_: Any) -> float:
    """1.0 when the extracted final answer equals the ground truth: as numbers ("0.5" ==
    "1/2" == "\\frac{1}{2}"), as normalised LaTeX, or as case-folded text."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    if answers_match(answer, str(ground_truth)):
        return 1.0
    return float(_normalise(answer) == _normalise(ground_truth))


@register_reward("char_match")
def char_match(response: str, ground_truth: Any, **_: Any) -> float:
    """Partial credit for short string tasks: the fraction of ground-truth characters
    reproduced at their position, scaled down by any length mismatch. 1.0 only for an exact
    match (after stripping surrounding whitespace)."""
    got, want = str(response).strip(), str(ground_truth).strip()
    if not want:
        return float(not got)
    hits = sum(a == b for a, b in zip(got, want, strict=False))
    return hits / max(len(got), len(want))


@register_reward(BY_DATA_SOURCE)
def by_data_source(response: str, ground_truth: Any, **_: Any) -> float:
    """The "task" entry: a marker meaning 'use each row's data_source'. `RewardRegistry`
    never calls it; calling it directly is a mistake."""
    raise RewardError(
        "reward 'task' dispatches on each row's data_source; score through RewardRegistry"
    )

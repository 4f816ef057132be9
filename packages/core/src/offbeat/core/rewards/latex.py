"""Final answers of math responses: `\\boxed{...}` with balanced braces, LaTeX answer
normalisation, and answer equality.

Knows nothing about rewards, datasets or models: text in, text (or a number) out. The
normalisation follows the MATH benchmark's answer checker (the `strip_string` rules that
verl's `math` scorer uses) plus a few of `math_dapo`'s: it removes spacing commands,
`\\left`/`\\right`, dollar signs, degrees, percent signs, trailing units and `\\text{}`
wrappers, unifies `\\dfrac`/`\\tfrac`/`a/b` as `\\frac{a}{b}`, and drops a short
`x =` prefix. Two answers match when they normalise to the same string or to the same
number (so `0.5`, `\\frac{1}{2}` and `1/2` all match).
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["answers_match", "as_number", "last_boxed", "normalize_answer"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _balanced(text: str, start: int) -> int | None:
    """Index just past the `}` closing the `{` at `text[start]`; None if unclosed.
    Escaped braces (`\\{`, `\\}`) are literal characters and do not count."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, nested braces
    included: `\\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`; also `\\boxed 5` -> `5`.
    None when there is no box, or the last one is never closed (a truncated response)."""
    text = str(text)
    starts = [(text.rfind(cmd), cmd) for cmd in _BOX_COMMANDS]
    idx, cmd = max(starts)
    if idx < 0:
        return None
    rest = idx + len(cmd)
    j = rest
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] == "{":
        end = _balanced(text, j)
        return None if end is None else text[j + 1 : end - 1].strip()
    if j > rest and j < len(text):  # "\boxed 5": up to the closing math delimiter or line end
        return re.split(r"[$\n]", text[j:])[0].strip() or None
    return None


# ---- normalisation --------------------------------------------------------------------
_UNIT_WORDS = (
    "units?|cm|centimeters?|m|meters?|km|kilometers?|mm|inch(?:es)?|in|feet|foot|ft|yards?|"
    "miles?|mph|kg|g|grams?|pounds?|lbs?|ounces?|oz|seconds?|sec|s|minutes?|min|hours?|hrs?|"
    "days?|weeks?|months?|years?|dollars?|cents?|degrees?|percent|points?|ways|sq"
)
_UNIT = rf"(?:{_UNIT_WORDS})(?:\^\{{?[23]\}}?)?"
# "12 \text{ cm}^2" (any value), "5 dollars" (a number, then a space and a unit word).
_TEXT_UNIT = re.compile(
    rf"^(.*?\S)\s*\\(?:text|mbox|textrm|mathrm)\{{\s*{_UNIT}\s*\}}(?:\^\{{?[23]\}}?)?\s*$"
)
_WORD_UNIT = re.compile(rf"^(.*?[\d}}])\s+{_UNIT}\s*$")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf|textit)\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac\s*([0-9a-zA-Z])\s*([0-9a-zA-Z])")  # \frac12
_FRAC_HALF_SHORT = re.compile(r"\\frac\s*([0-9a-zA-Z])\s*(?=\{)")  # \frac1{2}
_FRAC_SHORT_DEN = re.compile(r"(\\frac\{[^{}]*\})\s*([0-9a-zA-Z])")  # \frac{1}2
_SQRT_SHORT = re.compile(r"\\sqrt\s*([0-9a-zA-Z])")  # \sqrt3
_SLASH = re.compile(r"^(-?\d+)/(\d+)$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def normalize_answer(answer: str) -> str:
    """A canonical string for a LaTeX answer (see the module docstring for the rules)."""
    s = str(answer).strip().replace("\n", "")
    if "\\boxed" in s or "\\fbox" in s:
        s = last_boxed(s) or s
    s = s.replace("\\\\", "\\")  # doubly escaped backslashes
    for space in ("\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\displaystyle"):
        s = s.replace(space, " " if space in ("\\ ", "~") else "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])", "", s)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°", "", s)
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    if m := _TEXT_UNIT.match(s) or _WORD_UNIT.match(s):
        s = m.group(1)
    s = _TEXT_WRAPPER.sub(r"\1", s)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs.strip()) <= 2:  # "x = 5" -> "5"
        s = rhs.strip()
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF_SHORT.sub(r"\\frac{\1}", s)
    s = _FRAC_SHORT_DEN.sub(r"\1{\2}", s)
    s = s.replace(" ", "")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if m := _SLASH.match(s):
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    return s


_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}$")


def as_number(answer: str) -> Fraction | None:
    """The exact value of a normalised numeric answer (`12`, `-0.25`, `1,000`, `3/4`,
    `\\frac{3}{4}`), or None when it is not a plain number."""
    s = str(answer).strip()
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    try:
        if m := _FRAC.match(s):
            sign = -1 if m.group(1) else 1
            return sign * Fraction(m.group(2)) / Fraction(m.group(3))
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str, truth: str) -> bool:
    """True when the two answers normalise to the same string or the same number."""
    a, b = normalize_answer(predicted), normalize_answer(truth)
    if a == b:
        return bool(a)
    x, y = as_number(a), as_number(b)
    return x is not None and y is not None and x == y

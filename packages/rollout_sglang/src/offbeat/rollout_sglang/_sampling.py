"""Turn offbeat's plain sampling dict into SGLang's `sampling_params` JSON.

Keys are SGLang's own `SamplingParams` fields, passed through (SGLang's request parsing
validates them and answers 400 for a bad one), plus the names offbeat's other engines and
the rollout client use, renamed: `max_tokens` -> `max_new_tokens`, `min_tokens` ->
`min_new_tokens`, `seed` -> `sampling_seed`. `n` is not a key (one sequence per call).
Knows nothing about HTTP or the server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ALIASES", "to_sglang_sampling"]

ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed"}


def to_sglang_sampling(params: Mapping[str, Any]) -> dict[str, Any]:
    """Raises ValueError naming the key for an alias clash, `n`, or a bad token budget;
    never mutates `params`."""
    if not isinstance(params, Mapping):
        raise ValueError(
            f"sampling_params must be a mapping, got {type(params).__name__}: {params!r}"
        )
    out: dict[str, Any] = {}
    for key, value in params.items():
        if value is None:
            continue
        name = ALIASES.get(key, key)
        if name in out and out[name] != value:
            raise ValueError(
                f"sampling_params has {key}={value!r} and {name}={out[name]!r}; give one of them"
            )
        out[name] = value
    if out.get("n", 1) != 1:
        raise ValueError(f"sampling_params n={out['n']!r}: generate returns one sequence per call")
    out.pop("n", None)
    budget = out.get("max_new_tokens")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int) or budget < 1
    ):
        raise ValueError(f"sampling_params max_tokens={budget!r}: expected an int >= 1")
    return out

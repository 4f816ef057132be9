"""Turn offbeat's plain sampling dict into vLLM `SamplingParams` for the token-only hot path.

Knows nothing about the engine or the balancer. Keys are vLLM's own `SamplingParams` fields
(passed straight through, no lowest-common-denominator renaming) plus `max_new_tokens` as
an alias of `max_tokens`; `n` is not a key (the group size is `generate_group`'s argument).
Three fields are forced because the adapter relies on them:
`logprobs=0` (vLLM then returns the sampled token's log-probability), `detokenize=False`
(token ids only) and `output_kind=FINAL_ONLY` (one output per request, no per-token
Python objects).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from offbeat.rollout_vllm.compat import (
    RequestOutputKind,
    SamplingParams,
    SamplingType,
    sampling_param_fields,
)

__all__ = ["FORCED_KEYS", "sampling_keys", "score_params", "to_sampling_params"]

FORCED_KEYS: frozenset[str] = frozenset({"logprobs", "detokenize", "output_kind"})


def sampling_keys() -> frozenset[str]:
    """Every key `to_sampling_params` accepts."""
    return sampling_param_fields() | {"max_new_tokens"}


def to_sampling_params(params: Mapping[str, Any], n: int = 1) -> SamplingParams:
    """Validate `params` and build the `SamplingParams` the engine is given, for `n`
    samples of the prompt in one request (vLLM's parallel sampling: sample `i` gets
    `seed + i`). Greedy params (temperature 0) come back with `n=1`: vLLM refuses `n > 1`
    there, so the caller sends `n` requests (whose answers are the same).

    Raises ValueError naming the bad key or value; never mutates `params`.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: expected an int >= 1 (samples of the prompt)")
    if not isinstance(params, Mapping):
        raise ValueError(
            f"sampling_params must be a mapping, got {type(params).__name__}: {params!r}"
        )
    kwargs = dict(params)
    valid = sampling_keys()
    unknown = sorted(set(kwargs) - valid)
    if unknown:
        raise ValueError(
            f"unknown sampling key(s) {unknown}; valid keys are vLLM SamplingParams fields: "
            f"{sorted(valid)}"
        )
    if "max_new_tokens" in kwargs:
        alias = kwargs.pop("max_new_tokens")
        if kwargs.get("max_tokens") not in (None, alias):
            raise ValueError(
                f"sampling_params has max_tokens={kwargs['max_tokens']!r} and "
                f"max_new_tokens={alias!r}; give one of them"
            )
        kwargs["max_tokens"] = alias
    max_tokens = kwargs.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ValueError(f"sampling_params max_tokens={max_tokens!r}: expected an int >= 1")
    if kwargs.get("n", 1) != 1:
        raise ValueError(
            f"sampling_params n={kwargs['n']!r}: generate returns one sequence per call; "
            "call generate_group(request_id, prompt_ids, sampling_params, n) for a group"
        )
    kwargs.pop("n", None)
    for key in FORCED_KEYS & set(kwargs):
        kwargs.pop(key)
    _check_value_types(kwargs)
    kwargs.update(logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    try:
        sp = SamplingParams(**kwargs)
        if n > 1 and sp.sampling_type != SamplingType.GREEDY:
            sp = SamplingParams(**kwargs, n=n)
    except Exception as e:  # vLLM's VLLMValidationError is not a ValueError
        more = f" with n={n}" if n > 1 else ""
        raise ValueError(f"invalid sampling_params {dict(params)!r}{more}: {e}") from e
    return sp


def score_params(top_k: int = 0) -> SamplingParams:
    """The params of a scoring request (`compute_log_probs`): the log-probability of every
    prompt token (`prompt_logprobs=0`: the given token's only; `top_k`: also the k most
    likely tokens at each position) at temperature 1 with no truncation, and one
    generated token, which nobody reads."""
    return SamplingParams(
        max_tokens=1,
        temperature=1.0,
        top_p=1.0,
        prompt_logprobs=top_k,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _check_value_types(kwargs: Mapping[str, Any]) -> None:
    """Reject values vLLM would only trip over inside the engine: a wrong type there kills
    the engine core's input thread instead of failing this one request (seen with a None
    temperature coming from a parquet row)."""
    defaults = _defaults()
    for key, value in kwargs.items():
        if key == "max_tokens":  # checked above; None means "up to max_model_len"
            continue
        default = defaults.get(key)
        if default is None or isinstance(default, bool) or not isinstance(default, int | float):
            continue
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(
                f"sampling_params {key}={value!r}: expected a number "
                f"(vLLM's default is {default!r})"
            )


_DEFAULTS: dict[str, Any] | None = None


def _defaults() -> dict[str, Any]:
    global _DEFAULTS
    if _DEFAULTS is None:
        sp = SamplingParams()
        _DEFAULTS = {k: getattr(sp, k, None) for k in sampling_keys()}
    return _DEFAULTS

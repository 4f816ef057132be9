"""The sampling-dict -> vLLM SamplingParams conversion (no engine needed)."""

from __future__ import annotations

import pytest

from offbeat.rollout_vllm._sampling import sampling_keys, to_sampling_params
from offbeat.rollout_vllm.compat import RequestOutputKind


def test_keys_pass_through_and_hot_path_fields_are_forced():
    params = {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 1, "logprobs": 5}
    sp = to_sampling_params(params)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.seed) == (7, 0.5, 0.9, 1)
    assert sp.logprobs == 0 and sp.detokenize is False
    assert sp.output_kind == RequestOutputKind.FINAL_ONLY
    assert params["logprobs"] == 5  # the caller's dict is untouched


def test_a_group_size_becomes_vllms_n():
    sp = to_sampling_params({"max_tokens": 3, "seed": 4}, n=8)
    assert (sp.n, sp.seed, sp.output_kind) == (8, 4, RequestOutputKind.FINAL_ONLY)
    assert to_sampling_params({"max_tokens": 3}).n == 1
    # vLLM refuses n > 1 for greedy sampling: the server then sends n requests.
    assert to_sampling_params({"max_tokens": 3, "temperature": 0.0}, n=8).n == 1
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"n={bad!r}: expected an int >= 1"):
            to_sampling_params({"max_tokens": 3}, n=bad)
    with pytest.raises(ValueError, match="generate_group"):
        to_sampling_params({"max_tokens": 3, "n": 2}, n=2)


def test_max_new_tokens_is_an_alias():
    assert to_sampling_params({"max_new_tokens": 9}).max_tokens == 9
    assert to_sampling_params({"max_new_tokens": 9, "max_tokens": 9}).max_tokens == 9
    with pytest.raises(ValueError, match="give one of them"):
        to_sampling_params({"max_new_tokens": 9, "max_tokens": 8})


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"temprature": 1.0}, r"unknown sampling key\(s\) \['temprature'\]"),
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"max_tokens": True}, "max_tokens=True"),
        ({"n": 3}, "n=3"),
        ({"top_p": 2.0}, "top_p"),
        (["max_tokens", 3], "must be a mapping"),
        ({"temperature": None}, r"temperature=None: expected a number"),
        ({"top_k": "5"}, r"top_k='5': expected a number"),
    ],
)
def test_bad_params_name_the_problem(params, match):
    with pytest.raises(ValueError, match=match):
        to_sampling_params(params)


def test_valid_keys_are_public_sampling_params_fields():
    keys = sampling_keys()
    assert {"max_tokens", "max_new_tokens", "temperature", "ignore_eos", "stop_token_ids"} <= keys
    assert not any(k.startswith("_") for k in keys)

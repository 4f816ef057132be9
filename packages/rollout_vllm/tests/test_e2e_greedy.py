"""Greedy generation through client + balancer + vLLM adapter equals transformers'."""

from __future__ import annotations

import asyncio

import pytest

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.ckpt_engine import SyncTarget
from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig, RolloutServer

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]

N = 24
GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def test_adapter_implements_both_protocols(server):
    assert isinstance(server, RolloutServer)
    assert isinstance(server, SyncTarget)


async def test_greedy_matches_transformers(server, tiny_model, prompt_ids, hf_greedy):
    client = PartialRolloutClient(
        AsyncLoadBalancer({server.server_id: server}), PartialRolloutConfig(max_tokens=N)
    )
    outs = await asyncio.gather(
        *(client.generate(f"greedy-{i}", p, GREEDY) for i, p in enumerate(prompt_ids))
    )
    expected = hf_greedy(tiny_model, prompt_ids, N)
    for out, (ref_tokens, ref_logprobs) in zip(outs, expected, strict=True):
        assert out.token_ids == ref_tokens
        assert out.stop_reason == "length"
        assert out.logprobs == pytest.approx(ref_logprobs, abs=1e-3)
        assert out.min_weight_version == out.max_weight_version == server.weight_version
    # The random model's greedy text is varied, so equality is not a coincidence.
    assert len({t for out in outs for t in out.token_ids}) > 20


async def test_sampling_returns_the_sampled_tokens_logprobs(server, prompt_ids):
    out = await server.generate("sample", prompt_ids[0], {"max_tokens": 16, "seed": 3})
    assert len(out.token_ids) == len(out.logprobs) <= 16
    assert all(lp <= 0.0 for lp in out.logprobs)
    again = await server.generate("sample", prompt_ids[0], {"max_tokens": 16, "seed": 3})
    assert again.token_ids == out.token_ids


async def test_stop_on_eos_is_reported_as_stop(server, prompt_ids):
    # Make whatever greedy picks first a stop token: generation ends after one token.
    first = (await server.generate("s0", prompt_ids[0], {"max_tokens": 1, **GREEDY})).token_ids
    out = await server.generate(
        "s1", prompt_ids[0], {"max_tokens": 8, "temperature": 0.0, "stop_token_ids": first}
    )
    assert out.stop_reason == "stop"
    assert out.token_ids == first


async def test_sampled_logprobs_are_at_the_sampling_temperature(server, tiny_model, prompt_ids):
    """Importance sampling needs the behaviour policy's log-probs at temperature T, the same
    quantity the trainer computes from logits / T."""
    import torch
    from transformers import AutoModelForCausalLM

    temperature = 0.7
    prompt = prompt_ids[1]
    out = await server.generate(
        "temp", prompt, {"max_tokens": 12, "temperature": temperature, "seed": 5}
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    at_t = torch.log_softmax(logits / temperature, -1)
    expected = at_t.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0].tolist()
    raw = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert out.logprobs == pytest.approx(expected, abs=1e-3)
    assert raw.tolist() != pytest.approx(expected, abs=1e-3)  # the check can tell them apart

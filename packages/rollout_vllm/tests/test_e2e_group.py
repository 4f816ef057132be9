"""A GRPO group as one vLLM request (`generate_group`, vLLM's `n`): n samples whose
log-probs are their own tokens', and an abort in the middle returns every sample as it
stands, which the client completes sample by sample.

Sampled (not greedy) throughout: vLLM refuses `n > 1` for greedy sampling, so a greedy
group is n requests and would not exercise the group request. Each sample's log-probs are
checked against transformers on that sample's own prefix, so a token appended to the
wrong sample, lost or doubled on resume, would not match.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.ckpt_engine import CheckpointEngineManager
from offbeat.core.rollout import GroupRolloutServer, PartialRolloutClient, PartialRolloutConfig
from offbeat.rollout_vllm.compat import tokens_received

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]

N = 4
BUDGET = 150  # prompt (<= 48 tokens) + 150 < max_model_len (256)
T = 0.8
SAMPLED = {"temperature": T, "ignore_eos": True}


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def check_logprobs(model, prompt: list[int], out) -> None:
    """`out.logprobs[i]` is the log-probability of `out.token_ids[i]` at temperature T
    after prompt + the sample's own earlier tokens."""
    assert len(out.token_ids) == len(out.logprobs)
    if not out.token_ids:
        return
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    at_t = torch.log_softmax(logits[len(prompt) - 1 : -1] / T, -1)
    expected = at_t.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0].tolist()
    assert out.logprobs == pytest.approx(expected, abs=1e-3)


async def wait_for_tokens(server, n: int) -> None:
    """Until `n` samples inside the engine have produced a token (read from vLLM's output
    processor, test-only), so an abort now lands mid-response."""
    for _ in range(4000):
        if sum(t > 0 for t in tokens_received(server.engine)) >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"fewer than {n} samples produced a token in 20 s")


async def test_a_group_returns_n_samples_with_their_own_logprobs(server, hf_model, prompt_ids):
    """Sample i is also what one request seeded seed + i samples (vLLM's rule, which the
    client's fallback copies)."""
    assert isinstance(server, GroupRolloutServer)
    prompt = prompt_ids[2]
    params = {"max_tokens": 12, "temperature": T, "seed": 11}
    outs = await server.generate_group("grp", prompt, params, N)
    assert len(outs) == N
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the samples differ
    for out in outs:
        assert out.stop_reason in ("stop", "length") and out.token_ids
        assert out.min_weight_version == out.max_weight_version == server.weight_version
        check_logprobs(hf_model, prompt, out)
    singles = await asyncio.gather(
        *(server.generate(f"one-{i}", prompt, {**params, "seed": 11 + i}) for i in range(N))
    )
    assert [s.token_ids for s in singles] == [o.token_ids for o in outs]


async def test_a_greedy_group_is_n_requests(server, prompt_ids):
    greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    outs = await server.generate_group("grp-greedy", prompt_ids[3], greedy, 3)
    one = await server.generate("one-greedy", prompt_ids[3], greedy)
    assert [o.token_ids for o in outs] == [one.token_ids] * 3


async def test_abort_all_returns_every_sample_as_it_stands(server, hf_model, prompt_ids):
    prompt = prompt_ids[0]
    params = {"max_tokens": BUDGET, "seed": 5, **SAMPLED}
    task = asyncio.create_task(server.generate_group("grp-ab", prompt, params, N))
    await wait_for_tokens(server, N)
    await server.abort_all()
    assert task.done()  # abort_all returned after the group call did
    await server.resume()
    outs = task.result()
    assert len(outs) == N and all(o.stop_reason == "aborted" for o in outs)
    for out in outs:
        assert 0 < len(out.token_ids) < BUDGET
        check_logprobs(hf_model, prompt, out)


async def test_the_client_completes_a_group_across_a_weight_sync(
    server, tiny_model, hf_model, prompt_ids, load_named_tensors
):
    """A sync (abort -> transfer of the same weights -> resume) lands mid-group: every
    sample resumes as its own request and ends at its full budget, its log-probs still
    those of its own tokens."""
    prompt = prompt_ids[1]
    client = PartialRolloutClient(
        AsyncLoadBalancer({server.server_id: server}), PartialRolloutConfig(max_tokens=BUDGET)
    )
    v0 = server.weight_version
    task = asyncio.create_task(client.generate_group("grp-sync", prompt, SAMPLED, N))
    await wait_for_tokens(server, N)
    manager = CheckpointEngineManager("shm", phase_timeout_s=120)
    try:
        result = await manager.sync(load_named_tensors(tiny_model), v0 + 1, {"vllm": server})
    finally:
        manager.close()
    assert result.ok, result.failed
    outs = await asyncio.wait_for(task, 300)
    assert len(outs) == N
    assert len({tuple(o.token_ids) for o in outs}) == N
    for out in outs:
        assert len(out.token_ids) == BUDGET and out.stop_reason == "length"
        assert out.extra["num_attempts"] == 2  # the group call, then its own resume
        assert (out.min_weight_version, out.max_weight_version) == (v0, v0 + 1)
        assert out.weight_version == v0 + 1
        check_logprobs(hf_model, prompt, out)

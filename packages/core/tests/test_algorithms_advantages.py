"""Advantage estimators: GRPO (± std), RLOO, GAE, and their registry entries."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offbeat.core.algorithms import (
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    rloo_advantages,
    sequence_to_token_rewards,
)
from offbeat.core.registry import ADV_ESTIMATORS

MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
UIDS = ["a", "a", "a", "b", "b"]
REWARDS = torch.tensor([1.0, 0.0, 2.0, 5.0, 5.0])


def test_grpo_with_and_without_std():
    adv = grpo_advantages(REWARDS, MASK, UIDS)
    # group a: mean 1, unbiased std 1 -> (0, -1, 1); group b: all equal -> 0
    assert adv[:, 0].tolist() == pytest.approx([0.0, -1.0, 1.0, 0.0, 0.0], abs=1e-5)
    assert torch.equal(adv != 0, (adv != 0) & MASK.bool())  # zero on padding
    assert adv[1].tolist() == pytest.approx([-1.0] * 3, abs=1e-5)  # broadcast over tokens
    raw = grpo_advantages(REWARDS * 3, MASK, UIDS, norm_by_std=False)
    assert raw[:, 0].tolist() == pytest.approx([0.0, -3.0, 3.0, 0.0, 0.0])


def test_rloo_leave_one_out():
    adv = rloo_advantages(REWARDS, MASK, UIDS)
    # a: 1 - (0+2)/2 = 0, 0 - 1.5 = -1.5, 2 - 0.5 = 1.5
    assert adv[:, 0].tolist() == pytest.approx([0.0, -1.5, 1.5, 0.0, 0.0])


def test_singleton_groups_get_no_advantage():
    for fn in (grpo_advantages, rloo_advantages):
        adv = fn(torch.tensor([3.0, 1.0]), torch.ones(2, 2), ["x", "y"])
        assert torch.count_nonzero(adv) == 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=8))
def test_group_advantages_sum_to_zero(rewards):
    r = torch.tensor(rewards)
    mask = torch.ones(len(rewards), 1)
    for adv in (
        grpo_advantages(r, mask, ["g"] * len(r), norm_by_std=False),
        rloo_advantages(r, mask, ["g"] * len(r)),
    ):
        assert float(adv.sum()) == pytest.approx(0.0, abs=1e-4)


def naive_gae(rewards, values, length, gamma, lam):
    adv, nxt_adv = [0.0] * length, 0.0
    for t in reversed(range(length)):
        nxt_v = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * nxt_v - values[t]
        nxt_adv = delta + gamma * lam * nxt_adv
        adv[t] = nxt_adv
    return adv


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=4),
    st.floats(0.5, 1.0),
    st.floats(0.0, 1.0),
    st.integers(0, 1000),
)
def test_gae_matches_per_row_recursion(lengths, gamma, lam, seed):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()
    rewards = torch.randn(len(lengths), t, generator=g) * mask
    values = torch.randn(len(lengths), t, generator=g)  # garbage on padding on purpose
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    for i, n in enumerate(lengths):
        want = naive_gae(rewards[i].tolist(), values[i].tolist(), n, gamma, lam)
        assert adv[i, :n].tolist() == pytest.approx(want, abs=1e-4)
        assert adv[i, n:].abs().sum() == 0 and ret[i, n:].abs().sum() == 0
        assert ret[i, :n].tolist() == pytest.approx((adv[i, :n] + values[i, :n]).tolist())


def test_gae_whitened_and_monte_carlo_limit():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = sequence_to_token_rewards(torch.tensor([1.0, -1.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 1.0], [0.0, -1.0, 0.0]]
    # gamma = lam = 1, V = 0: advantage = return-to-go = final reward on every token
    adv, ret = gae_advantages(rewards, torch.zeros(2, 3), mask, whiten=False)
    assert adv.tolist() == [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]] and torch.equal(ret, adv)
    white, _ = gae_advantages(rewards, torch.zeros(2, 3), mask)
    assert float((white * mask).sum()) == pytest.approx(0.0, abs=1e-5)
    assert white[1, 2] == 0
    w = masked_whiten(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1, 1, 0]]))
    assert w.tolist()[0][:2] == pytest.approx([-0.7071, 0.7071], abs=1e-3) and w[0, 2] == 0


def test_registry_dispatch_uniform_signature():
    assert {"grpo", "rloo", "gae"} <= set(ADV_ESTIMATORS.names())
    opts = {"norm_by_std": False, "gamma": 1.0, "lam": 1.0}  # all options, each takes its own
    adv, ret = compute_advantages(
        "grpo", rewards=REWARDS, response_mask=MASK, group_uids=UIDS, **opts
    )
    assert torch.equal(adv, ret) and adv[2, 0] == pytest.approx(1.0)
    adv, _ = compute_advantages(
        "gae",
        rewards=torch.tensor([1.0]),
        response_mask=torch.ones(1, 2),
        group_uids=["x"],
        values=torch.zeros(1, 2),
        whiten=False,
        **opts,
    )
    assert adv.tolist() == [[1.0, 1.0]]
    assert ADV_ESTIMATORS.get("gae").needs_critic
    with pytest.raises(ValueError, match="needs the critic"):
        compute_advantages("gae", rewards=REWARDS, response_mask=MASK, group_uids=UIDS)
    with pytest.raises(KeyError, match="registered: gae, grpo, rloo"):
        compute_advantages("ppo", rewards=REWARDS, response_mask=MASK, group_uids=UIDS)
    with pytest.raises(ValueError, match="5 group ids for 2 rewards"):
        grpo_advantages(torch.zeros(2), torch.ones(2, 1), UIDS)

"""GAE and the aggregations on response masks with gaps (multi-turn: tool or observation
tokens inside a response are masked out), against a reference computation written the
way verl writes it (`compute_gae_advantage_return`: values and advantages carried
through masked positions)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offbeat.core.algorithms import (
    LossNormalizer,
    agg_loss,
    explained_variance,
    gae_advantages,
    masked_mean,
    masked_whiten,
    sequence_to_token_rewards,
)
from offbeat.core.algorithms.aggregation import AGG_MODES


def verl_gae(rewards, values, mask, gamma, lam):
    """verl's loop, transcribed: the next value and the running advantage skip masked
    positions (carried, not reset)."""
    next_values = torch.zeros(rewards.shape[0])
    last = torch.zeros(rewards.shape[0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_ = delta + gamma * lam * last
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last = last_ * mask[:, t] + (1 - mask[:, t]) * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def gappy_mask(rows: int, width: int, seed: int) -> torch.Tensor:
    """Random masks: a response of random length, with random spans masked inside it."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width)
    for i in range(rows):
        n = int(torch.randint(1, width + 1, (1,), generator=g))
        mask[i, :n] = (torch.rand(n, generator=g) > 0.35).float()
        mask[i, 0] = 1.0  # at least one policy token
    return mask


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_gae_with_gaps_matches_verl_reference(seed, gamma, lam):
    mask = gappy_mask(5, 9, seed)
    g = torch.Generator().manual_seed(seed + 1)
    # rewards and values only where the mask is 1: the reference reads masked ones.
    rewards = torch.randn(5, 9, generator=g) * mask
    values = torch.randn(5, 9, generator=g) * mask
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    want_adv, want_ret = verl_gae(rewards, values, mask, gamma, lam)
    m = mask.bool()
    torch.testing.assert_close(adv[m], want_adv[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret[m], want_ret[m], atol=1e-5, rtol=1e-5)
    assert adv[~m].abs().sum() == 0 and ret[~m].abs().sum() == 0


def test_a_gap_carries_value_and_advantage_instead_of_resetting():
    # turn 1 (2 tokens) | tool output (2 masked tokens) | turn 2 (1 token, reward 1)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    rewards = sequence_to_token_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]  # the last POLICY token
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.5, 9.0]])  # 9 on masked: never read
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    # gamma = lam = 1: the advantage is the return-to-go (1) minus the value, on turn 1 too
    assert adv[0].tolist() == pytest.approx([0.9, 0.8, 0.0, 0.0, 0.5, 0.0])
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    # a reset at the gap would have cut turn 1 off from the reward:
    adv_g, _ = gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0, whiten=False)
    # position 1: delta = 0 + 0.5 * V(4) - V(1) = 0.05, plus 0.5 * A(4) = 0.25 -> 0.3
    assert adv_g[0, 1].item() == pytest.approx(0.3)


def test_contiguous_masks_are_unchanged_by_the_gap_rule():
    lengths = torch.tensor([3, 5, 1])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).float()
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=g) * mask, torch.randn(3, 5, generator=g)
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    want, _ = verl_gae(rewards, values * mask, mask, 0.9, 0.8)
    torch.testing.assert_close(adv * mask, want * mask, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregations_count_only_the_policy_tokens_of_a_gappy_mask(mode):
    """Moving the masked-out tokens (gaps vs the same count at the end) changes no
    aggregate: only mask-1 positions are read, whatever garbage the gaps hold."""
    gappy = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 1.0]])
    packed = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    vals = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    garbage = torch.tensor(float("nan"))

    def spread(mask):
        out = torch.full(mask.shape, garbage)
        for i in range(2):
            out[i, mask[i].bool()] = vals[i]
        return out

    norm_g = LossNormalizer.from_mask(gappy, horizon=5)
    norm_p = LossNormalizer.from_mask(packed, horizon=5)
    assert (norm_g.num_tokens, norm_g.num_seqs) == (norm_p.num_tokens, norm_p.num_seqs)
    got = agg_loss(spread(gappy), gappy, mode, norm_g)
    want = agg_loss(spread(packed), packed, mode, norm_p)
    assert torch.isfinite(got) and got.item() == pytest.approx(want.item())
    assert masked_mean(spread(gappy), gappy).item() == pytest.approx(3.5)
    w = masked_whiten(spread(gappy), gappy)
    assert torch.isfinite(w).all() and w[~gappy.bool()].abs().sum() == 0


def test_explained_variance():
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    ret = torch.tensor([[1.0, 7.0, 2.0], [3.0, 4.0, 9.0]])
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert explained_variance(torch.zeros_like(ret) + 2.5, ret, mask) == pytest.approx(0.0)
    assert explained_variance(-ret, ret, mask) < 0

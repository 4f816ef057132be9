"""PPO (asymmetric + dual clip), decoupled PPO, rollout correction, KL, entropy, value loss."""

from __future__ import annotations

import math

import pytest
import torch

from offbeat.core.algorithms import (
    LossNormalizer,
    decoupled_ppo_loss,
    entropy_from_logits,
    entropy_loss,
    kl_loss,
    kl_penalty,
    ppo_loss,
    rollout_correction,
    value_loss,
)

ONE = LossNormalizer(num_tokens=1.0, num_seqs=1.0)


def token_loss(ratio: float, adv: float, **kw) -> tuple[float, float]:
    """(loss, d loss / d log pi) of one token with ratio pi/pi_old and advantage adv."""
    lp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out = ppo_loss(lp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1), ONE, **kw)
    out.loss.backward()
    return float(out.loss.detach()), float(lp.grad)


def test_asymmetric_clip():
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": None}
    # positive advantage: clipped (no gradient) above 1.28, not at 1.25
    assert token_loss(1.25, 1.0, **kw) == pytest.approx((-1.25, -1.25))
    assert token_loss(1.5, 1.0, **kw) == pytest.approx((-1.28, 0.0))
    # negative advantage: clipped below 0.8, unclipped above
    assert token_loss(0.5, -1.0, **kw) == pytest.approx((0.8, 0.0))
    assert token_loss(1.5, -1.0, **kw) == pytest.approx((1.5, 1.5))


def test_dual_clip_caps_negative_advantage_losses():
    loss, grad = token_loss(10.0, -2.0, clip_ratio_c=3.0)
    assert (loss, grad) == pytest.approx((6.0, 0.0))  # -A * c, no gradient
    assert token_loss(2.0, -2.0, clip_ratio_c=3.0) == pytest.approx((4.0, 4.0))  # below c
    assert token_loss(10.0, -2.0, clip_ratio_c=None)[0] == pytest.approx(20.0)
    assert token_loss(10.0, 2.0, clip_ratio_c=3.0)[0] == pytest.approx(-2.4)  # A > 0: normal


def test_ppo_metrics_and_masking():
    lp = torch.log(torch.tensor([[2.0, 1.0, 5.0]]))
    mask = torch.tensor([[1, 1, 0]])
    out = ppo_loss(lp, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 1.0]]), mask, ONE)
    assert out.metrics["actor/pg_clipfrac"] == pytest.approx(0.5)  # masked token ignored
    assert out.token_loss[0, 2] == 0
    assert float(out.loss) == pytest.approx(-1.2 - 1.0)


def test_rollout_correction_token_truncate_and_mask():
    prox = torch.log(torch.tensor([[1.0, 3.0, 0.2, 1.0]]))
    behav = torch.zeros(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]])
    tis = rollout_correction(prox, behav, mask, level="token", mode="truncate", threshold=2.0)
    assert tis.weights[0].tolist() == pytest.approx([1.0, 2.0, 0.2, 0.0])
    assert torch.equal(tis.mask, mask)
    mis = rollout_correction(prox, behav, mask, level="token", mode="mask", threshold=2.0)
    assert mis.mask[0].tolist() == [1, 0, 0, 0]  # 3 > 2 and 0.2 < 1/2 leave the loss
    assert mis.weights[0].tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])
    assert mis.metrics["rollout_is/outside_frac"] == pytest.approx(2 / 3)


def test_rollout_correction_sequence_level():
    # row 0: token ratios 1.5 * 1.5 = 2.25 (> 2); row 1: 1.5 * 0.8 = 1.2
    prox = torch.log(torch.tensor([[1.5, 1.5, 9.0], [1.5, 0.8, 1.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    prox = prox * mask  # row 1's third token has ratio 1
    tis = rollout_correction(prox, torch.zeros(2, 3), mask, level="sequence", threshold=2.0)
    torch.testing.assert_close(tis.weights, torch.tensor([[2.0, 2.0, 0.0], [1.2, 1.2, 1.2]]))
    mis = rollout_correction(prox, torch.zeros(2, 3), mask, level="sequence", mode="mask")
    assert mis.mask.tolist() == [[0, 0, 0], [1, 1, 1]]
    none = rollout_correction(prox, torch.zeros(2, 3), mask, level="none")
    assert torch.equal(none.mask, mask) and float(none.weights.min()) == 1.0
    with pytest.raises(ValueError, match="level='seq'"):
        rollout_correction(prox, prox, mask, level="seq")
    with pytest.raises(ValueError, match=r"threshold=0\.5"):
        rollout_correction(prox, prox, mask, threshold=0.5)


def test_decoupled_ppo_clips_around_proximal_and_weights_by_behaviour():
    lp = torch.log(torch.tensor([[1.5]])).requires_grad_()
    prox = torch.log(torch.tensor([[1.25]]))  # current / proximal = 1.2: inside the clip
    behav = torch.zeros(1, 1)  # proximal / behaviour = 1.25: IS weight
    out = decoupled_ppo_loss(
        lp, prox, behav, torch.ones(1, 1), torch.ones(1, 1), ONE, clip_ratio_high=0.28
    )
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(-1.2 * 1.25)
    assert float(lp.grad) == pytest.approx(-1.2 * 1.25)
    # proximal == behaviour: plain PPO (bypass)
    same = decoupled_ppo_loss(lp, prox, prox, torch.ones(1, 1), torch.ones(1, 1), ONE)
    plain = ppo_loss(lp, prox, torch.ones(1, 1), torch.ones(1, 1), ONE)
    assert float(same.loss.detach()) == pytest.approx(float(plain.loss.detach()))


def test_kl_estimators_values_and_clamp():
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    lr = math.log(2.0)
    assert float(kl_penalty(lp, ref, "k1")) == pytest.approx(lr)
    assert float(kl_penalty(lp, ref, "k2")) == pytest.approx(0.5 * lr * lr)
    assert float(kl_penalty(lp, ref, "k3")) == pytest.approx(0.5 - 1 + lr)
    huge = kl_penalty(torch.tensor([[-60.0]]), torch.zeros(1, 1), "k3", clamp=10.0)
    assert float(huge) == 10.0 and torch.isfinite(huge).all()
    assert float(kl_penalty(torch.tensor([[-60.0]]), torch.zeros(1, 1), "k1", 10.0)) == -10.0
    with pytest.raises(KeyError, match="registered: k1, k2, k3"):
        kl_penalty(lp, ref, "k4")


def test_k3_is_an_unbiased_nonnegative_kl_estimate():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g), 0)
    q = torch.softmax(torch.randn(6, generator=g), 0)
    samples = torch.multinomial(p, 200_000, replacement=True, generator=g)
    lp, lq = p.log()[samples], q.log()[samples]
    true_kl = float((p * (p.log() - q.log())).sum())
    for kind in ("k1", "k3"):
        est = kl_penalty(lp, lq, kind, clamp=100.0)
        assert float(est.mean()) == pytest.approx(true_kl, rel=0.05)
    assert float(kl_penalty(lp, lq, "k3").min()) >= 0.0


def test_kl_loss_and_entropy_bonus_aggregate_with_mask():
    mask = torch.tensor([[1, 1, 0]])
    n = LossNormalizer.from_mask(mask)
    lp = torch.tensor([[0.0, -1.0, -5.0]])
    loss = kl_loss(lp, torch.zeros(1, 3), mask, n, kind="k1")
    assert float(loss) == pytest.approx(-0.5)
    logits = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [5.0, -5.0]]])
    ent = entropy_from_logits(logits)
    want = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(ent, want)
    bonus = entropy_loss(ent, mask, n, coeff=0.1)
    assert float(bonus) == pytest.approx(-0.1 * math.log(2))


def test_value_loss_is_clipped():
    old = torch.zeros(1, 2)
    values = torch.tensor([[1.0, 0.1]], requires_grad=True)
    returns = torch.tensor([[2.0, 0.0]])
    out = value_loss(values, old, returns, torch.ones(1, 2), LossNormalizer(2.0, 1.0))
    # token 0: clipped V = 0.5 is further from R = 2 -> 0.5 * 1.5^2, gradient 0
    # token 1: unclipped 0.5 * 0.1^2 (the clipped value equals it)
    assert out.token_loss[0].tolist() == pytest.approx([1.125, 0.005])
    out.loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.05]]))
    assert out.metrics["critic/vf_clipfrac"] == pytest.approx(0.5)

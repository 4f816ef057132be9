"""Masked tokens never reach a loss, a gradient or a metric: NaN, +inf and -inf written
into the padding of every input leave each aggregation mode, each loss and each masked
statistic finite and equal to the clean result. Also the clip-fraction metrics, checked
on tokens built to fall into each clip region, against verl's definitions."""

from __future__ import annotations

import math

import pytest
import torch

from offbeat.core.algorithms import (
    AGG_MODES,
    LossNormalizer,
    agg_loss,
    decoupled_ppo_loss,
    entropy_loss,
    gae_advantages,
    kl_loss,
    masked_mean,
    masked_whiten,
    ppo_loss,
    rollout_correction,
    value_loss,
)
from offbeat.core.train.loss import PPOLoss, PPOLossConfig

POISONS = (math.nan, math.inf, -math.inf)
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])


def rand(seed: int, shape=MASK.shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def poisoned(x: torch.Tensor, value: float) -> torch.Tensor:
    """`x` with `value` on every masked token."""
    return x.masked_fill(MASK == 0, value)


def norm_of(mask: torch.Tensor) -> LossNormalizer:
    return LossNormalizer.from_mask(mask, horizon=6.0)


def assert_same_as_clean(fn, clean: dict, differentiable: set[str]):
    """For each poison: the loss, the gradient of every differentiable input and the
    metrics equal the clean run's, and are finite."""
    ref_loss, ref_grads, ref_metrics = _run(fn, clean, differentiable)
    assert math.isfinite(ref_loss)
    for value in POISONS:
        dirty = {k: poisoned(v, value) for k, v in clean.items()}
        # the poison is really there: a plain `x * mask` sum would not be finite
        assert not all(torch.isfinite((v * MASK).sum()) for v in dirty.values())
        loss, grads, metrics = _run(fn, dirty, differentiable)
        assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12), value
        for k, g in grads.items():
            assert torch.isfinite(g).all(), (k, value)
            torch.testing.assert_close(g, ref_grads[k])
            assert (g[MASK == 0] == 0).all(), (k, value)
        assert metrics.keys() == ref_metrics.keys()
        for k, m in metrics.items():
            assert math.isfinite(m), (k, value)
            assert m == pytest.approx(ref_metrics[k], rel=1e-9, abs=1e-12), (k, value)


def _run(fn, inputs: dict, differentiable: set[str]):
    """fn(**inputs) -> (scalar loss, metrics); returns (loss, {input: grad}, metrics)."""
    inputs = {k: v.clone() for k, v in inputs.items()}
    for k in differentiable:
        inputs[k].requires_grad_()
    loss, metrics = fn(**inputs)
    loss.backward()
    return float(loss.detach()), {k: inputs[k].grad for k in differentiable}, metrics


@pytest.mark.parametrize("mode", AGG_MODES)
def test_every_aggregation_mode_ignores_nonfinite_padding(mode):
    def fn(x):
        return agg_loss(x, MASK, mode, norm_of(MASK)), {}

    assert_same_as_clean(fn, {"x": rand(1)}, {"x"})


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("clip_ratio_c", [3.0, None])
def test_ppo_loss_ignores_nonfinite_padding(mode, clip_ratio_c):
    def fn(log_probs, old, adv, is_weights):
        out = ppo_loss(
            log_probs, old, adv, MASK, norm_of(MASK), mode=mode, clip_ratio_high=0.28,
            clip_ratio_c=clip_ratio_c, is_weights=is_weights,
        )  # fmt: skip
        assert torch.isfinite(out.token_loss).all() and (out.token_loss[MASK == 0] == 0).all()
        return out.loss, out.metrics

    clean = {
        "log_probs": -rand(2).abs(),
        "old": -rand(3).abs(),
        "adv": rand(4) * 2,
        "is_weights": rand(5).abs(),
    }
    assert_same_as_clean(fn, clean, {"log_probs"})


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("is_mode", ["truncate", "mask"])
def test_decoupled_ppo_and_rollout_correction_ignore_nonfinite_padding(level, is_mode):
    def fn(log_probs, prox, behav, adv):
        corr = rollout_correction(prox, behav, MASK, level=level, mode=is_mode, threshold=1.5)
        assert torch.isfinite(corr.weights).all()
        out = decoupled_ppo_loss(
            log_probs, prox, behav, adv, MASK, norm_of(corr.mask), is_level=level,
            is_mode=is_mode, is_threshold=1.5,
        )  # fmt: skip
        return out.loss, out.metrics

    clean = {
        "log_probs": -rand(6).abs(),
        "prox": -rand(7).abs(),
        "behav": -rand(8).abs(),
        "adv": rand(9),
    }
    assert_same_as_clean(fn, clean, {"log_probs"})


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_and_entropy_losses_ignore_nonfinite_padding(kind):
    def fn(log_probs, ref, entropy):
        kl = kl_loss(log_probs, ref, MASK, norm_of(MASK), kind=kind)
        ent = entropy_loss(entropy, MASK, norm_of(MASK), coeff=0.01, mode="seq-mean-token-mean")
        return kl + ent, {}

    clean = {"log_probs": -rand(10).abs(), "ref": -rand(11).abs(), "entropy": rand(12).abs()}
    assert_same_as_clean(fn, clean, {"log_probs", "entropy"})


def test_value_loss_ignores_nonfinite_padding():
    def fn(values, old, returns):
        out = value_loss(values, old, returns, MASK, norm_of(MASK), mode="seq-mean-token-sum")
        return out.loss, out.metrics

    clean = {"values": rand(13), "old": rand(14), "returns": rand(15)}
    assert_same_as_clean(fn, clean, {"values"})


def test_engine_loss_fn_ignores_nonfinite_padding():
    """The trainer's PPOLoss, prepare and call, with a KL term and an entropy bonus."""
    loss_fn = PPOLoss(PPOLossConfig(rollout_is_level="token", use_kl_loss=True, entropy_coeff=0.01))

    def fn(log_probs, entropy, old_log_probs, rollout_log_probs, ref_log_probs, advantages):
        batch = {
            "response_mask": MASK,
            "advantages": advantages,
            "old_log_probs": old_log_probs,
            "rollout_log_probs": rollout_log_probs,
            "ref_log_probs": ref_log_probs,
        }
        mb, prepared = loss_fn.prepare(batch)
        loss, metrics = loss_fn(log_probs, entropy, mb, norm_of(mb["loss_mask"]))
        return loss, {**prepared, **metrics}

    clean = {
        "log_probs": -rand(16).abs(),
        "entropy": rand(17).abs(),
        "old_log_probs": -rand(18).abs(),
        "rollout_log_probs": -rand(19).abs(),
        "ref_log_probs": -rand(20).abs(),
        "advantages": rand(21),
    }
    assert_same_as_clean(fn, clean, {"log_probs", "entropy"})


@pytest.mark.parametrize("value", POISONS)
def test_masked_statistics_ignore_nonfinite_padding(value):
    x = rand(22)
    assert float(masked_mean(poisoned(x, value), MASK)) == pytest.approx(float(x[MASK == 1].mean()))
    white = masked_whiten(poisoned(x, value), MASK)
    torch.testing.assert_close(white, masked_whiten(x, MASK))
    assert torch.isfinite(white).all() and (white[MASK == 0] == 0).all()
    rewards = torch.zeros_like(x)
    rewards[0, 2], rewards[1, 1], rewards[2, 3] = 1.0, -1.0, 0.5
    clean_adv, clean_ret = gae_advantages(rewards, x, MASK, gamma=0.9, lam=0.8)
    adv, ret = gae_advantages(
        poisoned(rewards, value), poisoned(x, value), MASK, gamma=0.9, lam=0.8
    )
    torch.testing.assert_close(adv, clean_adv)
    torch.testing.assert_close(ret, clean_ret)


def _verl_clip_fracs(log_probs, old, adv, mask, low, high, c):
    """verl's compute_policy_loss (core_algos.py), its clip metrics only."""
    ratio = torch.exp(log_probs - old)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    m = mask.double()
    pg_clipfrac = (torch.gt(pg_losses2, pg_losses1).double() * m).sum() / m.sum()
    pg_losses3 = -adv * c
    lower = torch.gt(clip_pg_losses1, pg_losses3) * (adv < 0).double()
    return float(pg_clipfrac), float((lower * m).sum() / m.sum())


def test_clip_fractions_on_constructed_tokens_match_verl():
    # (ratio, advantage): which clip cuts each token, with low 0.2, high 0.28, c 3
    tokens = [
        (1.5, 1.0),  # A > 0, r above 1.28: ordinary clip
        (0.5, -1.0),  # A < 0, r below 0.8: ordinary clip (on the negative side)
        (10.0, -1.0),  # A < 0, -A r = 10 above -A c = 3: dual clip
        (5.0, -2.0),  # A < 0, 10 above 6: dual clip
        (1.0, -1.0),  # no clip
        (1.1, 1.0),  # no clip
        (0.1, -1.0),  # masked: would be an ordinary clip on A < 0
        (50.0, -1.0),  # masked: would be a dual clip
    ]
    log_probs = torch.log(torch.tensor([[r for r, _ in tokens]], dtype=torch.float64))
    adv = torch.tensor([[a for _, a in tokens]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    old = torch.zeros_like(log_probs)
    out = ppo_loss(
        log_probs, old, adv, mask, norm_of(mask), clip_ratio_low=0.2, clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )  # fmt: skip
    m = out.metrics
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 6)  # tokens 0 and 1
    assert m["actor/pg_clipfrac_neg"] == pytest.approx(1 / 6)  # token 1
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(2 / 6)  # tokens 2 and 3 (dual clip)
    assert "actor/pg_dual_clipfrac" not in m  # one name per quantity
    verl_clipfrac, verl_lower = _verl_clip_fracs(log_probs, old, adv, mask, 0.2, 0.28, 3.0)
    assert m["actor/pg_clipfrac"] == pytest.approx(verl_clipfrac)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(verl_lower)
    # the dual clip off: nothing is dual-clipped, the ordinary clip is unchanged
    off = ppo_loss(
        log_probs, old, adv, mask, norm_of(mask), clip_ratio_high=0.28, clip_ratio_c=None
    )
    assert off.metrics["actor/pg_clipfrac_lower"] == 0.0
    assert off.metrics["actor/pg_clipfrac_neg"] == pytest.approx(1 / 6)

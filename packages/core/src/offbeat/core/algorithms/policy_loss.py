"""PPO policy losses: clipped surrogate with separate low/high clip and dual clip, and
decoupled PPO (trust region around the proximal policy, IS correction to the behaviour
policy).

Per micro-batch: log-prob tensors in, a scalar loss (this micro-batch's share of the
mini-batch loss, see `aggregation`) and detached metrics out. Values on masked tokens are
never read (they may be NaN or inf). Knows nothing about models.

Clip metrics use verl's names and meanings: `actor/pg_clipfrac` is the fraction of tokens
the ordinary clip cut, `actor/pg_clipfrac_lower` the fraction that the DUAL clip cut
(A < 0 and -A r above -A c); `actor/pg_clipfrac_neg` is the ordinary clip's share on
A < 0 tokens (r below 1 - clip_ratio_low), which verl does not report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offbeat.core.algorithms.aggregation import (
    LossNormalizer,
    agg_loss,
    masked_mean,
    zero_masked,
)
from offbeat.core.algorithms.correction import rollout_correction

__all__ = ["LossOutput", "decoupled_ppo_loss", "ppo_loss"]

_MAX_LOG_RATIO = 20.0


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    token_loss: torch.Tensor  # [B, T] before aggregation (0 on masked tokens)
    metrics: dict[str, float] = field(default_factory=dict)  # micro-batch token means


def ppo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: LossNormalizer,
    *,
    mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """Clipped surrogate: max(-A r, -A clip(r, 1 - low, 1 + high)) per token, r = pi / pi_old.

    Dual clip (clip_ratio_c > 1): for A < 0 the loss is also capped at -A c, so a huge
    ratio on a bad action cannot blow up the update. `is_weights` (detached, e.g. from
    `rollout_correction`) multiply the per-token loss. All [B, T]; `mask` is the loss mask.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        clip_ratio_c = None
    # Zero the masked positions of every input first: NaN there would otherwise reach the
    # loss, the metrics, and (through the chain rule) the gradient of log_probs.
    log_probs = zero_masked(log_probs, mask)
    old = zero_masked(old_log_probs.detach(), mask)
    adv = zero_masked(advantages.detach(), mask)
    log_ratio = (log_probs - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(pg1, pg2)
    token_loss = clipped
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if clip_ratio_c is not None:
        pg3 = -adv * clip_ratio_c
        dual = (adv < 0) & (pg3 < clipped)
        token_loss = torch.where(adv < 0, torch.minimum(clipped, pg3), clipped)
    if is_weights is not None:
        token_loss = token_loss * zero_masked(is_weights.detach(), mask)
    loss = agg_loss(token_loss, mask, mode, normalizer)
    with torch.no_grad():
        m = mask.to(torch.float32)
        cut = pg2 > pg1  # the ordinary clip took over
        metrics = {
            "actor/pg_clipfrac": float(masked_mean(cut.float(), m)),
            "actor/pg_clipfrac_neg": float(masked_mean(((adv < 0) & cut).float(), m)),
            "actor/pg_clipfrac_lower": float(masked_mean(dual.float(), m)),
            "actor/ppo_kl": float(masked_mean(-log_ratio, m)),
            "actor/ratio_mean": float(masked_mean(ratio, m)),
        }
    return LossOutput(loss, zero_masked(token_loss, mask), metrics)


def decoupled_ppo_loss(
    log_probs: torch.Tensor,
    proximal_log_probs: torch.Tensor,
    behaviour_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: LossNormalizer,
    *,
    mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    is_level: str = "token",
    is_mode: str = "truncate",
    is_threshold: float = 2.0,
    is_threshold_lower: float | None = None,
) -> LossOutput:
    """Decoupled PPO: clip r = pi / pi_prox around 1 (the trust region is the trainer's
    start-of-step weights), weight by pi_prox / pi_behav (the rollout's sampler) at
    `is_level` with `is_mode` (see `rollout_correction`; "none" gives weight 1).

    With `is_mode="mask"` the loss mask shrinks; the mini-batch's `normalizer` must have
    been counted on the corrected masks (call `rollout_correction` on the whole mini-batch
    first). Passing proximal == behaviour log-probs gives plain PPO (bypass mode).
    """
    corr = rollout_correction(
        proximal_log_probs,
        behaviour_log_probs,
        mask,
        level=is_level,
        mode=is_mode,
        threshold=is_threshold,
        threshold_lower=is_threshold_lower,
    )
    out = ppo_loss(
        log_probs,
        proximal_log_probs,
        advantages,
        corr.mask,
        normalizer,
        mode=mode,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        is_weights=corr.weights,
    )
    out.metrics.update(corr.metrics)
    return out

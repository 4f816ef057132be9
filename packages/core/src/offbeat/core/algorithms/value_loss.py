"""The critic's clipped value loss, aggregated like the policy loss (global normaliser).

Knows only value/return tensors; the critic model and GAE live elsewhere.
"""

from __future__ import annotations

import torch

from offbeat.core.algorithms.aggregation import (
    LossNormalizer,
    agg_loss,
    masked_mean,
    zero_masked,
)
from offbeat.core.algorithms.policy_loss import LossOutput

__all__ = ["value_loss"]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    normalizer: LossNormalizer,
    *,
    cliprange_value: float = 0.5,
    mode: str = "token-mean",
) -> LossOutput:
    """0.5 max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, ±cliprange).

    All [B, T]; returns this micro-batch's share of the mini-batch value loss. Values on
    masked tokens are never read.
    """
    values = zero_masked(values, mask)
    old, ret = zero_masked(old_values.detach(), mask), zero_masked(returns.detach(), mask)
    clipped = old + (values - old).clamp(-cliprange_value, cliprange_value)
    err, err_clipped = (values - ret).square(), (clipped - ret).square()
    token_loss = 0.5 * torch.maximum(err, err_clipped)
    loss = agg_loss(token_loss, mask, mode, normalizer)
    with torch.no_grad():
        metrics = {
            "critic/vf_clipfrac": float(masked_mean((err_clipped > err).float(), mask)),
            "critic/vpred_mean": float(masked_mean(values, mask)),
        }
    return LossOutput(loss, zero_masked(token_loss, mask), metrics)

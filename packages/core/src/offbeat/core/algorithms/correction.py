"""Rollout correction: importance weights between the proximal and the behaviour policy.

In asynchronous training a trajectory was sampled by older weights (the behaviour
policy, whose log-probs the rollout recorded) than the trainer's start-of-step weights
(the proximal policy). The ratio pi_prox / pi_behav corrects for that, per token or per
sequence, either truncated (weights capped at the threshold) or masked (tokens or
sequences outside [lower, upper] leave the loss). Knows only log-prob tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offbeat.core.algorithms.aggregation import masked_mean, zero_masked

__all__ = ["RolloutCorrection", "rollout_correction"]

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps the weights finite before truncation


@dataclass
class RolloutCorrection:
    weights: torch.Tensor  # [B, T] detached IS weights (1 where no correction applies)
    mask: torch.Tensor  # [B, T] loss mask after masking (equal to the input mask otherwise)
    metrics: dict[str, float]


def rollout_correction(
    proximal_log_probs: torch.Tensor,
    behaviour_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = 2.0,
    threshold_lower: float | None = None,
) -> RolloutCorrection:
    """IS weights pi_prox / pi_behav at `level` "token" | "sequence" | "none".

    `mode="truncate"`: weights = min(ratio, threshold) (truncated IS, TIS).
    `mode="mask"`: weights = ratio, and tokens (token level) or whole sequences (sequence
    level) whose ratio lies outside [threshold_lower, threshold] get mask 0 (masked IS);
    `threshold_lower` defaults to 1 / threshold. A sequence's ratio is the product of its
    token ratios. Compute this for the whole mini-batch BEFORE its loss normaliser: the
    returned mask is the loss mask to count.
    """
    if level not in ("none", "token", "sequence"):
        raise ValueError(f"rollout_correction: level={level!r}; valid: none, token, sequence")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"rollout_correction: mode={mode!r}; valid: truncate, mask")
    if threshold < 1.0:
        raise ValueError(f"rollout_correction: threshold={threshold} must be >= 1")
    m = mask.to(torch.float32)
    if level == "none":
        return RolloutCorrection(torch.ones_like(m), mask, {})
    lower = 1.0 / threshold if threshold_lower is None else threshold_lower
    log_ratio = zero_masked((proximal_log_probs.detach() - behaviour_log_probs.detach()).float(), m)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(m)
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    if mode == "truncate":
        weights = ratio.clamp(max=threshold)
        new_mask = mask
        outside = ratio > threshold
    else:
        outside = (ratio > threshold) | (ratio < lower)
        new_mask = mask * (~outside).to(mask.dtype)
        weights = ratio * (~outside).to(ratio.dtype)
    metrics = {
        "rollout_is/ratio_mean": float(masked_mean(ratio, m)),
        "rollout_is/max_ratio": float(ratio[m > 0].max()) if (m > 0).any() else 1.0,
        "rollout_is/outside_frac": float(masked_mean(outside.float(), m)),
    }
    return RolloutCorrection(zero_masked(weights, m), new_mask, metrics)

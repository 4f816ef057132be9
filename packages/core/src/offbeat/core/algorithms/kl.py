"""KL estimators (k1, k2, k3) against a reference policy, and the entropy bonus.

Per-token tensors in, per-token values or a globally normalised scalar out (see
`aggregation`). Knows nothing about where the reference log-probs come from.
"""

from __future__ import annotations

import torch

from offbeat.core.algorithms.aggregation import LossNormalizer, agg_loss, zero_masked
from offbeat.core.registry import KL_ESTIMATORS

__all__ = [
    "entropy_from_logits",
    "entropy_loss",
    "kl_loss",
    "kl_penalty",
    "topk_forward_kl",
]

_MAX_LOG_RATIO = 20.0


@KL_ESTIMATORS.register("k1")
def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio  # log pi/pi_ref: unbiased, high variance, can be negative


@KL_ESTIMATORS.register("k2")
def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


@KL_ESTIMATORS.register("k3")
def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # pi_ref/pi - 1 - log(pi_ref/pi): unbiased, non-negative, low variance (Schulman)
    r = -log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(r) - 1.0 - r


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3", clamp: float = 10.0
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) with estimator `kind` (a name in
    KL_ESTIMATORS), clamped to [-clamp, clamp] so one wild token cannot dominate."""
    log_ratio = log_probs - ref_log_probs.detach()
    return KL_ESTIMATORS.get(kind)(log_ratio).clamp(-clamp, clamp)


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    normalizer: LossNormalizer,
    *,
    kind: str = "k3",
    clamp: float = 10.0,
    mode: str = "token-mean",
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch KL (multiply by the KL coefficient).
    Log-probs on masked tokens are never read (NaN there leaves loss and gradient finite)."""
    log_probs, ref_log_probs = zero_masked(log_probs, mask), zero_masked(ref_log_probs, mask)
    return agg_loss(kl_penalty(log_probs, ref_log_probs, kind, clamp), mask, mode, normalizer)


def topk_forward_kl(
    log_probs_topk: torch.Tensor, teacher_log_probs_topk: torch.Tensor
) -> torch.Tensor:
    """Per-token forward KL(q || pi) over the teacher's top-k tokens: `[..., k]` log-probs
    of the same k token ids under the policy (with gradient) and the teacher; q is the
    teacher's top-k renormalised to sum to 1 (the mass outside the top-k is dropped, as
    top-k distillation does). Returns `[...]`, >= 0 up to the policy's own mass outside
    the k tokens."""
    q_log = torch.log_softmax(teacher_log_probs_topk.detach().float(), dim=-1)
    return (q_log.exp() * (q_log - log_probs_topk.float())).sum(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum softmax(z) z."""
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.logsumexp(logits.float(), dim=-1) - (probs * logits.float()).sum(-1)


def entropy_loss(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    normalizer: LossNormalizer,
    *,
    coeff: float,
    mode: str = "token-mean",
) -> torch.Tensor:
    """The entropy bonus as a loss term: -coeff × aggregated entropy (add it to the loss)."""
    return -coeff * agg_loss(entropy, mask, mode, normalizer)

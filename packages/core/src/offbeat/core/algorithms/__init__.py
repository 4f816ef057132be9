"""RL algorithms on per-token tensors: advantages, policy/value/KL/entropy losses,
rollout correction, the KL penalty in the reward (fixed or adaptive coefficient), and
globally normalised loss aggregation.

Importing this package registers the built-in advantage estimators (grpo, rloo, gae),
loss aggregation modes and KL estimators (k1, k2, k3) in `offbeat.core.registry`.
"""

from offbeat.core.algorithms.advantages import (
    compute_advantages,
    explained_variance,
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    rloo_advantages,
    sequence_to_token_rewards,
)
from offbeat.core.algorithms.aggregation import (
    AGG_MODES,
    LossNormalizer,
    agg_loss,
    global_normalizer,
    masked_mean,
    zero_masked,
)
from offbeat.core.algorithms.correction import RolloutCorrection, rollout_correction
from offbeat.core.algorithms.kl import (
    entropy_from_logits,
    entropy_loss,
    kl_loss,
    kl_penalty,
    topk_forward_kl,
)
from offbeat.core.algorithms.kl_control import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    FixedKLController,
    KLPenalty,
    apply_kl_penalty,
    build_kl_controller,
    token_mean_kl,
)
from offbeat.core.algorithms.policy_loss import LossOutput, decoupled_ppo_loss, ppo_loss
from offbeat.core.algorithms.value_loss import value_loss

__all__ = [
    "AGG_MODES",
    "KL_CONTROLLERS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLPenalty",
    "LossNormalizer",
    "LossOutput",
    "RolloutCorrection",
    "agg_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_advantages",
    "decoupled_ppo_loss",
    "entropy_from_logits",
    "entropy_loss",
    "explained_variance",
    "gae_advantages",
    "global_normalizer",
    "grpo_advantages",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_whiten",
    "ppo_loss",
    "rloo_advantages",
    "rollout_correction",
    "sequence_to_token_rewards",
    "token_mean_kl",
    "topk_forward_kl",
    "value_loss",
    "zero_masked",
]

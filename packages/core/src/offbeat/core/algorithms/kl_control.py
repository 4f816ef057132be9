"""The KL penalty in the reward, as the classic PPO-RLHF setups do it: each response
token's reward loses beta × KL(pi_old || pi_ref) at that token, with beta held fixed or
steered by an adaptive controller towards a target KL (Ziegler et al. 2019, as in verl).

Knows only per-token tensors and a scalar coefficient; nothing about where the log-probs
come from or when the trainer steps the controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from offbeat.core.algorithms.aggregation import masked_mean, zero_masked
from offbeat.core.algorithms.kl import kl_penalty

__all__ = [
    "KL_CONTROLLERS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLPenalty",
    "apply_kl_penalty",
    "build_kl_controller",
    "token_mean_kl",
]

KL_CONTROLLERS = ("fixed", "adaptive")


class FixedKLController:
    """beta stays what it was set to."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to steer."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """beta *= 1 + clip(KL / target - 1, -0.2, 0.2) × n_steps / horizon: a KL above the
    target raises beta (a stronger pull towards the reference), one below lowers it.
    `n_steps` is how many samples the measured KL came from; `horizon` how many samples
    the correction is spread over."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if not target_kl > 0 or not horizon > 0:
            raise ValueError(
                f"adaptive KL controller: target_kl={target_kl!r} and horizon={horizon!r} "
                "must be > 0"
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = max(-0.2, min(0.2, current_kl / self.target - 1.0))
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


def build_kl_controller(
    kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """`kind` is one of `KL_CONTROLLERS`."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"KL controller {kind!r}: must be one of {KL_CONTROLLERS}")


@dataclass
class KLPenalty:
    """What `apply_kl_penalty` produced."""

    token_rewards: torch.Tensor  # [B, T] scores - beta × KL, 0 on masked positions
    kl: torch.Tensor  # [B, T] per-token KL estimate, 0 on masked positions
    current_kl: float  # mean over sequences of each sequence's token-mean KL
    beta: float  # the coefficient that was applied


def apply_kl_penalty(
    token_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    *,
    kind: str = "k1",
    clamp: float = 10.0,
) -> KLPenalty:
    """token_scores - beta × KL estimator `kind` per token (over the mask only).

    `log_probs` are the policy that sampled (old) log-probs: the penalty is part of the
    reward the rollout earned, computed once per batch, without gradient."""
    m = mask.to(torch.float32)
    with torch.no_grad():
        kl = zero_masked(kl_penalty(log_probs.float(), ref_log_probs.float(), kind, clamp), m)
        rewards = zero_masked(token_scores.float(), m) - beta * kl
        per_seq = kl.sum(-1) / m.sum(-1).clamp(min=1.0)
        has = m.sum(-1) > 0
        current = float(per_seq[has].mean()) if bool(has.any()) else 0.0
    return KLPenalty(rewards, kl, current, float(beta))


def token_mean_kl(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, kind: str = "k1"
) -> float:
    """Token mean of the KL estimate over the mask (for metrics)."""
    with torch.no_grad():
        return float(masked_mean(kl_penalty(log_probs.float(), ref_log_probs.float(), kind), mask))

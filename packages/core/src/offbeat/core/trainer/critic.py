"""The critic in the training loop: values for each batch, GAE from them (gamma, lam from
`algorithm.*`), and the critic's own updates on the step's mini-batches after the actor's.

Knows nothing about the engine behind it beyond `compute_values`, `update`, `save` and
`load` (built through the train-engine registry: `build_critic_engine`), nor about
rollout or weight sync. Every method here blocks: the trainer runs them in worker threads.
"""

from __future__ import annotations

from typing import Any

import torch

from offbeat.core.algorithms import compute_advantages, explained_variance, masked_mean

__all__ = ["Critic"]


def _rows(data: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    return {k: v[start:stop] for k, v in data.items()}


class Critic:
    """`engine`: a critic engine (see `offbeat.core.train.critic`); `ppo_epochs`: passes
    of the critic over each mini-batch per global step."""

    def __init__(
        self, engine: Any, *, gamma: float = 1.0, lam: float = 1.0, ppo_epochs: int = 1
    ) -> None:
        self.engine = engine
        self.gamma = gamma
        self.lam = lam
        self.ppo_epochs = ppo_epochs

    def advantages(
        self,
        estimator: str,
        data: dict[str, torch.Tensor],
        rewards: torch.Tensor,
        token_rewards: torch.Tensor,
        group_uids: list[str],
    ) -> dict[str, float]:
        """Values of the batch under the critic's current weights, then the estimator's
        advantages and returns from them; sets data's ``values``, ``returns`` and
        ``advantages``. Returns `critic/*` metrics of the batch (explained variance of
        the values before this step's critic update)."""
        mask = data["response_mask"]
        values = self.engine.compute_values(data)
        adv, returns = compute_advantages(
            estimator, rewards=rewards, response_mask=mask, group_uids=group_uids,
            values=values, gamma=self.gamma, lam=self.lam, token_rewards=token_rewards,
        )  # fmt: skip
        data["values"], data["returns"], data["advantages"] = values, returns, adv.float()
        return {
            "critic/vf_explained_var": explained_variance(values, returns, mask),
            "critic/values_mean": float(masked_mean(values, mask)),
            "critic/returns_mean": float(masked_mean(returns, mask)),
            "critic/advantages_mean": float(masked_mean(adv, mask)),
        }

    def update(
        self, data: dict[str, torch.Tensor], rows_per_mini_batch: int, mini_batches: int
    ) -> list[dict[str, float]]:
        """`ppo_epochs` passes over the step's mini-batches (the actor's), one clipped
        value-loss update each; returns each update's metrics."""
        out = []
        for _ in range(self.ppo_epochs):
            for k in range(mini_batches):
                mb = _rows(data, k * rows_per_mini_batch, (k + 1) * rows_per_mini_batch)
                out.append(self.engine.update(mb))
        return out

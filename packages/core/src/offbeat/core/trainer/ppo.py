"""What a global step adds when the job has a critic and/or a reference model (PPO with
GAE, a KL loss, a KL penalty in the reward), between building the batch and the
actor's updates, and after them:

    ref_log_probs (reference) -> rewards per token, minus beta × KL when the KL is in
    the reward (controller stepped) -> values (critic) -> advantages (GAE, or the
    outcome estimator on the penalised rewards) -> actor update(s) -> critic update(s)

In a job both models live on the ranks of a worker group, the actor's
(`critic.placement=actor`, `ref.placement=actor`; one rank in the driver when the
trainer runs there) or their own, and their engines are the group's proxies
(`offbeat.core.runtime.GroupCriticEngine`, `GroupReferenceEngine`); a script builds bare
ones in its process (`offbeat.core.train.build_critic_engine`). Knows nothing about
rollout, the buffer or weight sync; the blocking engine calls run in worker threads.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import torch

from offbeat.core import trace
from offbeat.core.algorithms import compute_advantages, sequence_to_token_rewards
from offbeat.core.metrics import MetricsAggregator
from offbeat.core.trainer.critic import Critic
from offbeat.core.trainer.reference import Reference

if TYPE_CHECKING:
    from offbeat.core.config.schema import AlgorithmConfig, CriticConfig, RolloutConfig

__all__ = ["CriticAndReference"]


def _engine_given(engine: Any, role: str, needed_by: str) -> None:
    if engine is None:
        raise ValueError(
            f"CriticAndReference.build: {needed_by} needs a {role} engine; pass the trainer "
            f"side's, or build one: build_{role}_engine(job) (offbeat.core.train)"
        )


class CriticAndReference:
    """The optional critic and reference of a run, and the step hooks the trainer calls:
    `prepare` (before the actor's updates) and `update_critic` (after them)."""

    def __init__(
        self,
        *,
        critic: Critic | None = None,
        reference: Reference | None = None,
        adv_estimator: str = "grpo",
        norm_by_std: bool = True,
    ) -> None:
        self.critic = critic
        self.reference = reference
        self.adv_estimator = adv_estimator
        self.norm_by_std = norm_by_std

    @classmethod
    def build(
        cls,
        algorithm: AlgorithmConfig,
        critic: CriticConfig,
        rollout: RolloutConfig,
        *,
        critic_engine: Any = None,
        reference_engine: Any = None,
    ) -> CriticAndReference | None:
        """The job's critic over `critic_engine` (when `algorithm.adv_estimator` needs one:
        `algorithm.gamma`, `algorithm.lam`, `critic.ppo_epochs`) and its reference over
        `reference_engine` (when a KL term reads it: `algorithm`'s KL keys, at the
        rollout's temperature); None when it needs neither. The engines are the trainer
        side's, or a script's (`build_critic_engine(job)`, `build_reference_engine(job)`)."""
        from offbeat.core.config.support import needs_critic, needs_reference

        al = algorithm
        values = None
        if needs_critic(al.adv_estimator):
            _engine_given(critic_engine, "critic", f"algorithm.adv_estimator={al.adv_estimator!r}")
            values = Critic(critic_engine, gamma=al.gamma, lam=al.lam, ppo_epochs=critic.ppo_epochs)
        reference = None
        if needs_reference(al):
            _engine_given(reference_engine, "reference", "a KL term (algorithm.use_kl_*)")
            # Greedy rollout (temperature 0) has no distribution to match: score at 1 then.
            temperature = rollout.temperature if rollout.temperature > 0 else 1.0
            reference = Reference(reference_engine, al, temperature)
            _ = reference.fingerprint  # now, at build time, not on the event loop later
        if values is None and reference is None:
            return None
        return cls(
            critic=values, reference=reference, adv_estimator=al.adv_estimator,
            norm_by_std=al.norm_adv_by_std_in_grpo,
        )  # fmt: skip

    @property
    def rewrites_advantages(self) -> bool:
        """True when the advantages are not the outcome estimator's on the raw rewards."""
        return self.critic is not None or (
            self.reference is not None and self.reference.controller is not None
        )

    async def prepare(
        self, data: dict[str, torch.Tensor], rewards: torch.Tensor, group_uids: list[str]
    ) -> dict[str, float]:
        """Add ``ref_log_probs`` and (when rewritten) ``advantages``, ``values`` and
        ``returns`` to `data`; `data` must hold the step's ``old_log_probs``. Returns the
        step's metrics, with `timing/ref_log_prob_s` and `timing/values_s`."""
        metrics: dict[str, float] = {}
        mask = data["response_mask"]
        token_rewards = sequence_to_token_rewards(rewards, mask)
        if self.reference is not None:
            t0 = time.perf_counter()
            with trace.span("ref_log_prob"):
                data["ref_log_probs"] = await asyncio.to_thread(self.reference.log_probs, data)
            metrics["timing/ref_log_prob_s"] = time.perf_counter() - t0
            metrics.update(self.reference.kl_metrics(data))
            if self.reference.controller is not None:
                pen, kl = self.reference.penalise(token_rewards, data)
                token_rewards = pen.token_rewards
                metrics.update(kl)
        if self.critic is not None:
            t0 = time.perf_counter()
            with trace.span("values"):
                critic_metrics = await asyncio.to_thread(
                    self.critic.advantages, self.adv_estimator, data,
                    token_rewards.sum(-1), token_rewards, group_uids,
                )  # fmt: skip
            metrics.update(critic_metrics)
            metrics["timing/values_s"] = time.perf_counter() - t0
        elif self.rewrites_advantages:  # the KL penalty changed the outcome rewards
            adv, _ = compute_advantages(
                self.adv_estimator, rewards=token_rewards.sum(-1), response_mask=mask,
                group_uids=group_uids, norm_by_std=self.norm_by_std,
            )  # fmt: skip
            data["advantages"] = adv.float()
        return metrics

    async def update_critic(
        self, data: dict[str, torch.Tensor], rows_per_mini_batch: int, mini_batches: int
    ) -> dict[str, float]:
        """The critic's updates on the step's mini-batches (after the actor's), merged;
        with `timing/critic_update_s`."""
        if self.critic is None:
            return {}
        t0 = time.perf_counter()
        with trace.span("critic_update"):
            updates = await asyncio.to_thread(
                self.critic.update, data, rows_per_mini_batch, mini_batches
            )
        agg = MetricsAggregator()
        for u in updates:
            agg.add(u)
        merged = agg.result()
        merged["timing/critic_update_s"] = time.perf_counter() - t0
        return merged

    # ---- checkpoint ----------------------------------------------------------------------
    def engines(self) -> dict[str, Any]:
        """Engines whose state a checkpoint holds beside the actor's (the reference is
        frozen: it is rebuilt from model.path, and `state` proves it is the same)."""
        return {"critic": self.critic.engine} if self.critic is not None else {}

    def state(self) -> dict[str, Any]:
        return {"reference": self.reference.state() if self.reference is not None else None}

    def load_state(self, state: dict[str, Any]) -> None:
        if self.reference is not None and state.get("reference") is not None:
            self.reference.load_state(state["reference"])

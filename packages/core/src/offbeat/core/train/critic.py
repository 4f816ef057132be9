"""The critic of the FSDP2 backend: a value model (the policy architecture with a scalar
head in place of the LM head) trained with the clipped value loss, globally normalised
over the mini-batch like the policy loss.

Knows nothing about GAE, rewards or the trainer: it turns a padded batch into per-token
values V_t (the value of the state before response token t, the same positions whose
logits give log pi(token t)) and runs one value-loss update on a mini-batch that carries
``values`` (the old values, for the clip) and ``returns``. Its optimizer, LR schedule,
micro-batches, grad clipping and checkpoints are its own (the FSDP2 engine's machinery,
configured from `critic.*`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from offbeat.core.algorithms import LossNormalizer, masked_mean, value_loss, zero_masked
from offbeat.core.train import _sharding
from offbeat.core.train.engine import (
    LossFn,
    batch_field,
    register_critic_engine,
    updates_per_run,
)
from offbeat.core.train.fsdp2 import FSDP2Config, FSDP2TrainEngine
from offbeat.core.train.optim import OptimConfig

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

__all__ = [
    "FSDP2CriticEngine",
    "ValueLoss",
    "ValueLossConfig",
    "build_value_model",
    "critic_engine_config",
    "value_loss_config",
]


@dataclass
class ValueLossConfig:
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    horizon: float | None = None  # as PPOLossConfig.horizon (seq-mean-token-sum-norm)


class ValueLoss:
    """The critic engine's `LossFn`: reads ``values`` (old values) and ``returns``."""

    needs_entropy = False

    def __init__(self, config: ValueLossConfig | None = None) -> None:
        self.config = config or ValueLossConfig()
        if not self.config.cliprange_value > 0:
            raise ValueError(f"critic.cliprange_value={self.config.cliprange_value!r}: must be > 0")
        self.horizon = self.config.horizon

    def prepare(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        batch_field(batch, "values")
        batch_field(batch, "returns")
        return dict(batch), {}

    def __call__(
        self,
        vpreds: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: dict[str, Any],
        normalizer: LossNormalizer,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb["loss_mask"]
        out = value_loss(
            vpreds, mb["values"], mb["returns"], mask, normalizer,
            cliprange_value=self.config.cliprange_value, mode=self.config.loss_agg_mode,
        )  # fmt: skip
        metrics = dict(out.metrics)
        metrics["critic/vf_loss"] = float(masked_mean(out.token_loss.detach(), mask))
        return out.loss, metrics


def build_value_model(
    path: str, *, trust_remote_code: bool = False, override_config: dict | None = None
) -> nn.Module:
    """The HF causal LM at `path` with its LM head replaced by a Linear(hidden, 1) value
    head (weights ~ N(0, initializer_range), bias 0), as a token-classification model
    with one label is initialised. The backbone starts from the checkpoint."""
    model = _sharding.load_hf_model(path, trust_remote_code, override_config)
    old = model.get_output_embeddings()
    hidden = old.in_features if isinstance(old, nn.Linear) else model.config.hidden_size
    head = nn.Linear(hidden, 1, bias=True)
    std = float(getattr(model.config, "initializer_range", 0.02) or 0.02)
    with torch.no_grad():
        head.weight.normal_(0.0, std)
        head.bias.zero_()
    model.set_output_embeddings(head)
    model.config.tie_word_embeddings = False  # the head no longer shares the embedding
    return model


def value_loss_config(job: JobConfig) -> ValueLossConfig:
    """The critic's value loss: critic.cliprange_value, the algorithm's aggregation, and
    rollout.max_tokens as the horizon (as the policy loss's)."""
    return ValueLossConfig(
        cliprange_value=job.critic.cliprange_value,
        loss_agg_mode=job.algorithm.loss_agg_mode,
        horizon=float(job.rollout.max_tokens),
    )


def critic_engine_config(job: JobConfig) -> FSDP2Config:
    """The critic's FSDP2 settings from `critic.*` (its own optimizer and LR schedule: the
    horizon is `updates_per_run` with critic.ppo_epochs), the model's and the device."""
    c = job.critic
    return FSDP2Config(
        model_path=c.model_path or job.model.path,
        device=job.resources.device,
        micro_batch_size=c.ppo_micro_batch_size_per_device,
        param_dtype=job.model.dtype,
        gradient_checkpointing=job.actor.gradient_checkpointing,
        trust_remote_code=job.model.trust_remote_code,
        override_config=dict(job.model.override_config),
        fused_log_probs=False,  # a value head, not an LM head: nothing to fuse
        optim=OptimConfig(
            lr=c.lr,
            weight_decay=c.weight_decay,
            grad_clip=c.grad_clip,
            warmup_updates=c.lr_warmup_steps,
            total_updates=updates_per_run(job, c.ppo_epochs),
        ),
    )


@register_critic_engine("fsdp2")
class FSDP2CriticEngine(FSDP2TrainEngine):
    """One data-parallel rank of an FSDP2-sharded value model.

    `compute_values(batch)` -> [B, R] float32 values (0 on masked positions);
    `update(mini_batch)` -> one clipped value-loss step, metrics named `critic/*`
    (`critic/vf_loss`, `critic/vf_clipfrac`, `critic/vpred_mean`, `critic/grad_norm`,
    `critic/lr`, ...). Save/load as the actor engine's.
    """

    @classmethod
    def from_job_config(  # type: ignore[override]
        cls, job: JobConfig, *, model: nn.Module | None = None, loss_fn: LossFn | None = None
    ) -> FSDP2CriticEngine:
        return cls(
            critic_engine_config(job),
            loss_fn=loss_fn or ValueLoss(value_loss_config(job)),
            model=model,
        )

    def __init__(
        self, config: FSDP2Config, loss_fn: LossFn | None = None, model: nn.Module | None = None
    ) -> None:
        if model is None:
            model = build_value_model(
                config.model_path,
                trust_remote_code=config.trust_remote_code,
                override_config=config.override_config,
            )
        super().__init__(config, loss_fn=loss_fn or ValueLoss(), model=model)

    def _forward(
        self, mb: dict[str, Any], temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        values = self._response_logits(mb)[..., 0].float()
        return zero_masked(values, mb["response_mask"]), None

    def compute_values(self, batch: Any) -> torch.Tensor:
        """Values [B, R] (float32, on CPU) of this rank's batch; 0 where response_mask is 0."""
        return self.compute_log_probs(batch, 1.0)

    def update(self, mini_batch: Any, temperature: float | None = None) -> dict[str, float]:
        metrics = super().update(mini_batch, 1.0)
        out = {}
        for name, value in metrics.items():
            if name.startswith("actor/"):
                name = "critic/" + name[len("actor/") :]
            out[name] = value
        return out

    def export_weights(self) -> Any:  # type: ignore[override]
        raise NotImplementedError("the critic serves no rollout engine: it exports no weights")

"""AdamW and the learning-rate schedule of a train engine.

The schedule's clock is the number of PPO mini-batch updates (optimizer steps), not
global steps or epochs: with `parameter_sync_step` updates per global step, a run of N
global steps has a horizon of N x parameter_sync_step updates. Knows nothing about
sharding: it sees whatever parameters the engine hands it (DTensors under FSDP2).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from offbeat.core.config.schema import ActorConfig

__all__ = [
    "LR_SCHEDULES",
    "OptimConfig",
    "actor_optim",
    "build_lr_scheduler",
    "build_optimizer",
    "lr_factor",
]

LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine")


@dataclass
class OptimConfig:
    """AdamW, gradient clipping and the LR schedule (warm-up, then constant or cosine).

    `total_updates` is the horizon in mini-batch updates; the cosine schedule needs it
    (> warm-up), the constant one ignores it. `grad_clip <= 0` disables clipping.
    """

    lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    lr_schedule: str = "constant"
    warmup_updates: int = 0
    total_updates: int = 0
    min_lr_ratio: float = 0.0

    def validate(self, prefix: str = "optim") -> None:
        """Raise ValueError naming the key, the bad value and what would be valid."""
        if not self.lr > 0:
            raise ValueError(f"{prefix}.lr={self.lr!r}: must be > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"{prefix}.betas={self.betas!r}: must be two numbers in [0, 1)")
        if self.weight_decay < 0:
            raise ValueError(f"{prefix}.weight_decay={self.weight_decay!r}: must be >= 0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"{prefix}.lr_schedule={self.lr_schedule!r}: must be one of {LR_SCHEDULES}"
            )
        if self.warmup_updates < 0:
            raise ValueError(f"{prefix}.warmup_updates={self.warmup_updates!r}: must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"{prefix}.min_lr_ratio={self.min_lr_ratio!r}: must be in [0, 1]")
        if self.lr_schedule == "cosine" and self.total_updates <= self.warmup_updates:
            raise ValueError(
                f"{prefix}.total_updates={self.total_updates!r}: the cosine schedule needs a "
                f"horizon (in mini-batch updates) > {prefix}.warmup_updates="
                f"{self.warmup_updates}, e.g. total_steps x parameter_sync_step"
            )


def actor_optim(actor: ActorConfig, total_updates: int) -> OptimConfig:
    """The policy's optimizer and LR schedule from the `actor` section, over a horizon of
    `total_updates` mini-batch updates (`offbeat.core.train.engine.updates_per_run`)."""
    return OptimConfig(
        lr=actor.lr,
        weight_decay=actor.weight_decay,
        grad_clip=actor.grad_clip,
        warmup_updates=actor.lr_warmup_steps,
        lr_schedule=actor.lr_schedule,
        min_lr_ratio=actor.min_lr_ratio,
        total_updates=total_updates,
    )


def lr_factor(config: OptimConfig, update: int) -> float:
    """Multiplier of `config.lr` for the optimizer step that follows `update` completed
    updates: linear warm-up from 1/warmup to 1, then constant or cosine down to
    `min_lr_ratio` at `total_updates` (and held there after it)."""
    if update < config.warmup_updates:
        return (update + 1) / config.warmup_updates
    if config.lr_schedule == "constant":
        return 1.0
    span = config.total_updates - config.warmup_updates
    progress = min(1.0, (update - config.warmup_updates) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def build_optimizer(params: Iterable[torch.nn.Parameter], config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable `params` (DTensors under FSDP2: the update is elementwise,
    so each rank steps its own shard). On CUDA it is the fused kernel (one launch for all
    parameters instead of a chain of multi-tensor ops); elsewhere torch's default."""
    trainable = [p for p in params if p.requires_grad]
    fused = bool(trainable) and all(p.device.type == "cuda" for p in trainable)
    return torch.optim.AdamW(
        trainable,
        lr=config.lr,
        betas=(float(config.betas[0]), float(config.betas[1])),
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=True if fused else None,
    )


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose `last_epoch` counts mini-batch updates; its state_dict is what a
    checkpoint needs to resume the schedule exactly."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: lr_factor(config, update))

"""Training backends: the TrainEngine contract and its registry, the FSDP2 engine, the PPO
loss it optimises, its critic (value model, value loss), and the optimizer / LR schedule."""

from offbeat.core.train.actor import make_train_engine_actor
from offbeat.core.train.engine import (
    TRAIN_ENGINES,
    LossFn,
    TrainEngine,
    batch_field,
    build_actor_engine,
    build_critic_engine,
    build_reference_engine,
    build_train_engine,
    log_prob_temperature,
    register_train_engine,
    updates_per_run,
)
from offbeat.core.train.fsdp2 import FSDP2Config, FSDP2TrainEngine, actor_engine_config, hf_name
from offbeat.core.train.loss import PPOLoss, PPOLossConfig, ppo_loss_config

# critic imports fsdp2: keep it after it.
from offbeat.core.train.critic import (  # isort: skip
    FSDP2CriticEngine,
    ValueLoss,
    ValueLossConfig,
    build_value_model,
    critic_engine_config,
    value_loss_config,
)
from offbeat.core.train.optim import (
    LR_SCHEDULES,
    OptimConfig,
    actor_optim,
    build_lr_scheduler,
    build_optimizer,
    lr_factor,
)

__all__ = [  # contract + registry, the FSDP2 engine, its loss, optimizer and LR schedule
    "LR_SCHEDULES",
    "TRAIN_ENGINES",
    "FSDP2Config",
    "FSDP2CriticEngine",
    "FSDP2TrainEngine",
    "LossFn",
    "OptimConfig",
    "PPOLoss",
    "PPOLossConfig",
    "TrainEngine",
    "ValueLoss",
    "ValueLossConfig",
    "actor_engine_config",
    "actor_optim",
    "batch_field",
    "build_actor_engine",
    "build_critic_engine",
    "build_lr_scheduler",
    "build_optimizer",
    "build_reference_engine",
    "build_train_engine",
    "build_value_model",
    "critic_engine_config",
    "hf_name",
    "log_prob_temperature",
    "lr_factor",
    "make_train_engine_actor",
    "ppo_loss_config",
    "register_train_engine",
    "updates_per_run",
    "value_loss_config",
]

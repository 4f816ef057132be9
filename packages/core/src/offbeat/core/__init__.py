"""offbeat.core: the pieces every offbeat job shares.

Config and validation, the trajectory batch, RL algorithms, the rollout client, the
replay buffer, the FSDP2 train engine and the trainer loop. Knows no engine (vLLM,
SGLang) and no Megatron: those live in their own packages and plug in through registries.

Names are resolved lazily so `import offbeat.core` stays cheap (no Ray, no transformers
until a piece that needs them is touched).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, tuple[str, ...]] = {
    # configuration and registries
    "offbeat.core.config": ("JobConfig", "ConfigError", "load_config", "validate"),
    "offbeat.core.registry": ("Registry",),
    "offbeat.core.device": ("get_device", "current_device", "register_device"),
    # data and algorithms
    "offbeat.core.data": ("Trajectory", "TrajectoryBatch"),
    "offbeat.core.algorithms": ("compute_advantages", "ppo_loss", "decoupled_ppo_loss", "agg_loss"),
    "offbeat.core.metrics": ("MetricsAggregator",),
    # rollout side
    "offbeat.core.rollout": ("TokenOutput", "RolloutServer", "PartialRolloutClient"),
    "offbeat.core.models": ("build_tiny_model",),
    # training side
    "offbeat.core.buffer": ("ReplayBuffer",),
    "offbeat.core.train": ("TrainEngine", "FSDP2TrainEngine"),
    "offbeat.core.trainer": ("Trainer",),
    # the distributed runtime
    "offbeat.core.runtime": ("ResourcePools", "PoolSpec", "TrainerGroup"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["__version__", *_WHERE]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'offbeat.core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

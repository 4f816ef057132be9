"""Typed job configuration: the schema, loading (YAML + overrides) and validation."""

from offbeat.core.config.load import load_config, parse_overrides
from offbeat.core.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    AsyncConfig,
    CriticConfig,
    DataConfig,
    JobConfig,
    KLControlConfig,
    ModelConfig,
    ReferenceConfig,
    ResourceConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from offbeat.core.config.validation import ConfigError, Problem, Problems, check, validate

# Rules on what today's runtime can run (registered on import).
from offbeat.core.config import support  # noqa: F401  isort: skip

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "AsyncConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "JobConfig",
    "KLControlConfig",
    "ModelConfig",
    "Problem",
    "Problems",
    "ReferenceConfig",
    "ResourceConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "check",
    "load_config",
    "parse_overrides",
    "validate",
]

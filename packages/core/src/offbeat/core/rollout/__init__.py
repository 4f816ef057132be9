"""Rollout: the engine-replica protocol and the client that hides interruptions from the
agent loop. Engines themselves live in offbeat-rollout-vllm / offbeat-rollout-sglang."""

from offbeat.core.rollout.client import PartialRolloutClient, PartialRolloutConfig
from offbeat.core.rollout.protocol import (
    STOP_REASONS,
    GroupRolloutServer,
    RolloutServer,
    ScoringRolloutServer,
    StopReason,
    TokenOutput,
    TopKScoringRolloutServer,
    sample_params,
    supports_group,
    supports_scoring,
    supports_top_scoring,
)

__all__ = [
    "STOP_REASONS",
    "GroupRolloutServer",
    "PartialRolloutClient",
    "PartialRolloutConfig",
    "RolloutServer",
    "ScoringRolloutServer",
    "StopReason",
    "TokenOutput",
    "TopKScoringRolloutServer",
    "sample_params",
    "supports_group",
    "supports_scoring",
    "supports_top_scoring",
]

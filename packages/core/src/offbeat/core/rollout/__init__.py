"""Rollout: the engine-replica protocol and the client that hides interruptions from the
agent loop. Engines themselves live in offbeat-rollout-vllm / offbeat-rollout-sglang."""

from offbeat.core.rollout.client import PartialRolloutClient, PartialRolloutConfig
from offbeat.core.rollout.protocol import STOP_REASONS, RolloutServer, StopReason, TokenOutput

__all__ = [
    "STOP_REASONS",
    "PartialRolloutClient",
    "PartialRolloutConfig",
    "RolloutServer",
    "StopReason",
    "TokenOutput",
]

"""The staleness-bounded replay buffer between rollout and training."""

from offbeat.core.buffer.actor import AsyncReplayBuffer, make_buffer_actor
from offbeat.core.buffer.group import GroupStatus, PromptGroup
from offbeat.core.buffer.prompt_ledger import (
    PromptAccountingError,
    PromptDuplicated,
    PromptLedger,
    PromptLost,
)
from offbeat.core.buffer.replay_buffer import (
    STRATEGIES,
    BufferConfig,
    ReplayBuffer,
    drop_depth_message,
)

__all__ = [  # items, the pure core, blocking shells
    "STRATEGIES",
    "AsyncReplayBuffer",
    "BufferConfig",
    "GroupStatus",
    "PromptAccountingError",
    "PromptDuplicated",
    "PromptGroup",
    "PromptLedger",
    "PromptLost",
    "ReplayBuffer",
    "drop_depth_message",
    "make_buffer_actor",
]

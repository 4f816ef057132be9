"""The items a replay buffer holds: prompt groups and the trajectories sampled for them.

Knows nothing about tokenizers, engines or training: a trajectory (`offbeat.core.data`)
is token ids, log-probs, a reward and the weight versions that produced it; a group is one
prompt's `n` samples with a lifecycle (pending -> running -> finished | failed) and the
step it was submitted at.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from offbeat.core.data import Trajectory


class GroupStatus(enum.StrEnum):
    PENDING = "pending"  # submitted, waiting for a rollout worker
    RUNNING = "running"  # a worker is generating its samples
    FINISHED = "finished"  # every sample has a reward; waiting to be trained on
    FAILED = "failed"  # a reward function or the engine raised; evicted and counted


@dataclass
class PromptGroup:
    """One prompt and the `n` trajectories sampled for it (a GRPO group).

    `uid` is unique within a run and survives checkpoint/resume; `seq` orders groups by
    submission (oldest first). `prompt` is the dataset row the agent loop needs (chat
    messages, data_source, ground truth): the buffer never looks inside it.
    """

    uid: str
    seq: int
    prompt: dict[str, Any]
    submission_step: int
    status: GroupStatus = GroupStatus.PENDING
    trajectories: list[Trajectory] = field(default_factory=list)
    error: str | None = None

    def span(self, current_step: int) -> int:
        """Steps this group's data has lived: current step - submission step + 1."""
        return current_step - self.submission_step + 1

    @property
    def min_weight_version(self) -> int | None:
        if not self.trajectories:
            return None
        return min(t.min_weight_version for t in self.trajectories)

    def to_dict(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "seq": self.seq,
            "prompt": self.prompt,
            "submission_step": self.submission_step,
            "status": self.status.value,
            "trajectories": [asdict(t) for t in self.trajectories],
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PromptGroup:
        return cls(
            uid=d["uid"],
            seq=d["seq"],
            prompt=d["prompt"],
            submission_step=d["submission_step"],
            status=GroupStatus(d["status"]),
            trajectories=[Trajectory(**t) for t in d["trajectories"]],
            error=d.get("error"),
        )

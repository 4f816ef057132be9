"""The critic and the reference policy of a worker group, shaped as the engines the
training loop's `Critic` and `Reference` (offbeat.core.trainer) call.

Those call their engine in worker threads and block: `GroupCriticEngine` and
`GroupReferenceEngine` turn each call into the group's coroutine, run on the group's
event loop (`TrainerGroup._block_on`), which splits the batch across the ranks by token
count and puts the rows back in order. The reference's weights fingerprint was taken on
the ranks when they built it; its weights, like the actor's, never come to the driver.

Knows only the group's methods; nothing of the engines inside the ranks, nor of GAE or
KL.
"""

from __future__ import annotations

from typing import Any

import torch

from offbeat.core.runtime.group import TrainerGroup

__all__ = ["GroupCriticEngine", "GroupReferenceEngine"]


def _require(group: TrainerGroup, role: str) -> None:
    if role not in group.roles:
        raise ValueError(
            f"this trainer group's ranks hold {list(group.roles)}, no {role}: start it with "
            f"roles including {role!r}"
        )


class GroupCriticEngine:
    """The critic engine of `group` (ranks built with the "critic" role): blocking
    `compute_values`, `update`, `save` and `load`, for worker threads."""

    def __init__(self, group: TrainerGroup) -> None:
        _require(group, "critic")
        self.group = group

    def compute_values(self, batch: dict[str, Any]) -> torch.Tensor:
        return self.group._block_on("compute_values", lambda: self.group.compute_values(batch))

    def update(self, mini_batch: dict[str, Any]) -> dict[str, float]:
        return self.group._block_on("update_critic", lambda: self.group.update_critic(mini_batch))

    def save(self, path: str) -> None:
        self.group.save(path, role="critic")

    def load(self, path: str) -> None:
        self.group.load(path, role="critic")

    def __repr__(self) -> str:
        return f"GroupCriticEngine({self.group.dp_size} ranks)"


class GroupReferenceEngine:
    """The frozen reference policy of `group` (ranks built with the "reference" role):
    blocking `compute_log_probs`, for worker threads; `weights_fingerprint()` as the ranks
    computed it at build time."""

    def __init__(self, group: TrainerGroup) -> None:
        _require(group, "reference")
        if group.reference_fingerprint is None:
            raise ValueError("the trainer group's ranks reported no reference fingerprint")
        self.group = group

    def compute_log_probs(
        self, batch: dict[str, Any], temperature: float | None = None
    ) -> torch.Tensor:
        return self.group._block_on(
            "ref_log_probs", lambda: self.group.ref_log_probs(batch, temperature)
        )

    def weights_fingerprint(self) -> list[float]:
        return list(self.group.reference_fingerprint or [])

    def export_weights(self) -> Any:
        return self.group.export_weights()  # refuses: the weights stay on the ranks

    def __repr__(self) -> str:
        return f"GroupReferenceEngine({self.group.dp_size} ranks)"

"""The receiving side's contract: what a rollout replica implements so the
CheckpointEngineManager can update its weights.

Knows nothing about vLLM or SGLang. A replica is driven through five phases,
abort -> release KV -> transfer -> resume KV -> resume, and in the transfer phase it runs
the backend's receiver *in the process that owns the model* (for vLLM: inside the worker,
through a worker extension) with the picklable `ReceiveSpec` the sender created.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

# What a model exposes to receive weights: HF-style (name, tensor) pairs, e.g. vLLM's
# `model.load_weights`. It may be called many times (once per bucket).
LoadWeightsFn = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


@dataclass(frozen=True)
class ReceiveSpec:
    """Everything a receiver needs to join one sync; small and picklable (no tensors).

    `backend` names the registered backend, `version` the weight version being sent,
    `channel` holds backend-specific rendezvous data (shm names, a store address, a
    directory...), `rank` the receiver's rank within the sync when the backend has ranks.
    """

    backend: str
    version: int
    channel: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    checksum: bool = False
    timeout_s: float = 300.0


@runtime_checkable
class SyncTarget(Protocol):
    """One replica as the manager sees it. All methods are async; implementations that wrap
    a Ray actor await its ObjectRefs.

    `weight_version` is read without awaiting, so it must not block: a proxy of a remote
    replica returns the last version it saw, or None when it knows none yet (the manager
    then skips its stale-version check and lets `update_weights` refuse an older one)."""

    @property
    def weight_version(self) -> int | None: ...

    async def abort_all(self) -> None: ...

    async def release_kv_cache(self) -> None: ...

    async def update_weights(self, spec: ReceiveSpec) -> int:
        """Run the backend's receiver for `spec` where the model lives, loading every
        (name, tensor) into the model; return the version now held. Must refuse a version
        older than the one held, and must not report `spec.version` unless every bucket
        arrived intact."""
        ...

    async def resume_kv_cache(self) -> None: ...

    async def resume(self) -> None: ...

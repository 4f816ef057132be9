"""Weight sync from a TrainerGroup: the CheckpointEngineManager drives the replicas from
the driver, and the sender is trainer rank 0, where the weights are.

`GroupCheckpointEngine` is a `CheckpointEngineManager` whose backend is a proxy: opening a
sync asks rank 0 to open the real backend's sender (kept on rank 0 across syncs, like
the manager keeps its own) and brings back only the receivers' small `ReceiveSpec`s; the
transfer asks every rank to iterate its engine's export (each parameter's gather is a
collective of all ranks, one full parameter at a time) while rank 0 packs what it
gathers into the buckets. The driver sees specs and reports, never a tensor. A rank
that fails during a sync fails the sync with `TrainerRankFailed` instead of being
reported as every replica failing. With the one rank in the driver (a local group) the
same calls run on the rank's threads here: the sender reads the engine's export as it
is produced, as a bare engine's manager would.

Knows nothing about what a rank's engine is, nor about the replicas behind the targets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from offbeat.ckpt_engine import CheckpointEngineManager, get_backend
from offbeat.ckpt_engine.registry import Backend, NamedTensors, Sender, SendReport
from offbeat.ckpt_engine.target import ReceiveSpec
from offbeat.core.runtime.group import TrainerGroup

__all__ = ["GroupCheckpointEngine", "GroupSenderBackend", "group_backend_options"]


def group_backend_options(backend: str, group: TrainerGroup, device: str) -> dict[str, Any]:
    """Options for `backend` opened on rank 0: `broadcast` binds its store to rank 0's
    node address (receivers on other nodes reach it there) on the device's collectives.
    A rank in this process (no rendezvous address) opens the backend with its defaults,
    as a `CheckpointEngineManager` of the driver does."""
    if backend == "broadcast" and group.local_rank is None:
        return {"host": group.master[0], "device": "cpu" if device == "cpu" else device}
    return {}


class _RankSender(Sender):
    """The manager's handle on rank 0's sender; `send` runs in the manager's worker
    thread and awaits the ranks on the event loop."""

    def __init__(self, group: TrainerGroup, specs: list[ReceiveSpec], slot: str) -> None:
        self._group, self._specs, self._slot = group, specs, slot

    def spec(self, rank: int) -> ReceiveSpec:
        return self._specs[rank]

    def send(self, named_tensors: NamedTensors) -> SendReport:
        # `named_tensors` is the group's marker (its weights are not on the driver): unread.
        refs = [h.send_weights.remote(self._slot) for h in self._group.handles]
        return self._group._blocking("weight sync", refs)[0]

    def drop(self, rank: int, reason: str) -> None:
        self._group.handles[0].drop_receiver.remote(rank, reason, self._slot)

    def abort(self, reason: str) -> None:
        self._group.handles[0].abort_send.remote(reason, self._slot)


class GroupSenderBackend(Backend):
    """The registered backend `name`, opened on rank 0 of `group` with `options`; `slot`
    keeps it apart from the other managers' backends on rank 0."""

    def __init__(
        self,
        group: TrainerGroup,
        name: str,
        options: Mapping[str, Any] | None = None,
        slot: str = "rollout",
    ):
        cls = get_backend(name)
        self.name, self.slot = name, slot
        self.default_bucket_bytes = cls.default_bucket_bytes
        self.reach, self.device_types = cls.reach, cls.device_types
        self._group, self._options = group, dict(options or {})

    def open_sender(self, **kwargs: Any) -> Any:
        """An awaitable of the sender (the manager awaits it): rank 0 opens the real one."""

        async def open_on_rank0() -> _RankSender:
            h = self._group.handles[0]
            ref = h.open_sender.remote(self.name, self._options, kwargs, self.slot)
            specs = await self._group._one(0, "opening the weight sync", ref)
            return _RankSender(self._group, specs, self.slot)

        return open_on_rank0()

    @classmethod
    def receive(cls, spec: ReceiveSpec, load_weights, current_version):  # pragma: no cover
        raise TypeError("receivers use the backend named in their spec, not the group proxy")

    def close(self) -> None:
        """Not awaited: `GroupCheckpointEngine.aclose` waits for rank 0 to close it."""
        if self._group.failed is None:
            self._group.handles[0].close_backend.remote(self.slot)

    async def aclose(self, timeout_s: float = 30.0) -> None:
        if self._group.failed is None:
            ref = self._group.handles[0].close_backend.remote(self.slot)
            with contextlib.suppress(Exception):  # rank 0 gone: the backend went with it
                await asyncio.wait_for(ref, timeout_s)


class GroupCheckpointEngine(CheckpointEngineManager):
    """A `CheckpointEngineManager` whose transfers come from `group`'s ranks."""

    def __init__(
        self,
        group: TrainerGroup,
        backend: str,
        *,
        backend_options: Mapping[str, Any] | None = None,
        slot: str = "rollout",
        **kwargs: Any,
    ) -> None:
        super().__init__(GroupSenderBackend(group, backend, backend_options, slot), **kwargs)
        self.group = group

    async def aclose(self) -> None:
        """Close the backend on rank 0 and wait for it (`close` only asks)."""
        await self._backend.aclose()

    async def sync(self, named_tensors, version: int, targets=None):
        """As `CheckpointEngineManager.sync`; raises `TrainerRankFailed` when a trainer
        rank failed during it (then the replicas are not to blame)."""
        result = await super().sync(named_tensors, version, targets)
        if self.group.failed is not None:
            raise self.group.failed
        return result

"""Blocking access to the replay buffer: an asyncio shell, and a Ray actor made from it.

Knows nothing about the rules (they live in `ReplayBuffer`); it only wakes waiters when
the buffer changes. The trainer and the rollout workers run in one event loop and share an
`AsyncReplayBuffer`; when the workers live in other processes, `make_buffer_actor` puts
the same class behind a Ray actor, created in this one small factory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from offbeat.core.buffer.group import PromptGroup
from offbeat.core.buffer.replay_buffer import BufferConfig, ReplayBuffer
from offbeat.core.data import Trajectory


class AsyncReplayBuffer:
    """`ReplayBuffer` with awaitable waits. Not thread-safe: use it from one event loop."""

    def __init__(self, config: BufferConfig, *, start_step: int = 1) -> None:
        self.core = ReplayBuffer(config, start_step=start_step)
        self._changed = asyncio.Condition()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait_until(self, predicate, timeout: float | None) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(predicate), timeout)

    # ---- steps and admission -------------------------------------------------------------
    async def begin_step(self, step: int) -> None:
        self.core.begin_step(step)
        await self._notify()

    async def wait_for_slots(self, timeout: float | None = None) -> int:
        """Wait until at least one new prompt may be submitted; return how many."""
        await self._wait_until(lambda: self.core.free_slots() > 0, timeout)
        return self.core.free_slots()

    async def submit(
        self, prompts: Sequence[dict[str, Any]], positions: Sequence[int] | None = None
    ) -> list[PromptGroup]:
        groups = self.core.submit(prompts, positions)
        await self._notify()
        return groups

    # ---- rollout side --------------------------------------------------------------------
    async def take_pending(
        self, max_groups: int | None = None, timeout: float | None = None
    ) -> list[PromptGroup]:
        """Wait for pending groups and take (mark running) up to `max_groups` of them."""
        await self._wait_until(lambda: self.core.counts()["pending"] > 0, timeout)
        return self.core.take_pending(max_groups)

    async def finish(self, uid: str, trajectories: list[Trajectory]) -> None:
        self.core.finish(uid, trajectories)
        await self._notify()

    async def fail(self, uid: str, error: str, reason: str = "error") -> None:
        self.core.fail(uid, error, reason)
        await self._notify()

    # ---- trainer side --------------------------------------------------------------------
    async def sample(
        self, num_groups: int, timeout: float | None = None
    ) -> tuple[list[PromptGroup], list[PromptGroup]]:
        """Wait until `num_groups` finished groups may be taken; return (batch, evicted),
        where `evicted` are the stale groups dropped while waiting."""
        evicted: list[PromptGroup] = []

        def ready() -> bool:
            stale = self.core.evict_stale()
            if stale:
                evicted.extend(stale)
                # Slots reopened: wake the feeder (we hold the lock; it runs after we wait).
                self._changed.notify_all()
            return self.core.ready(num_groups)

        await self._wait_until(ready, timeout)
        batch = self.core.sample(num_groups)
        await self._notify()
        return batch, evicted

    # ---- plain passthroughs (awaitable so a Ray actor handle looks the same) -------------
    async def counts(self) -> dict[str, int]:
        return self.core.counts()

    async def ledger(self) -> dict[str, str]:
        return self.core.ledger()

    async def check_accounting(self) -> None:
        self.core.check_accounting()

    async def state_dict(self) -> dict[str, Any]:
        return self.core.state_dict()

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        self.core.load_state_dict(state)
        await self._notify()


def make_buffer_actor(config: BufferConfig, *, start_step: int = 1, **ray_options: Any):
    """Start an `AsyncReplayBuffer` as a Ray actor (Ray must be initialised)."""
    import ray

    options = {"num_cpus": 0, "max_concurrency": 1000, **ray_options}
    return ray.remote(**options)(AsyncReplayBuffer).remote(config, start_step=start_step)

"""The pool of rollout replicas as the trainer sees it: weight syncs and failures.

Knows nothing about what runs inside a replica (any object implementing `RolloutServer`
and `SyncTarget`, local or a Ray actor proxy) or how bytes travel (the
CheckpointEngineManager's backend). A replica that dies, stops answering, or fails a
weight sync is removed from the balancer, so new and resumed requests go elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from offbeat.ckpt_engine import CheckpointEngineManager, SyncResult

logger = logging.getLogger(__name__)


class NoReplicasLeft(RuntimeError):
    """Every rollout replica was removed."""


class ReplicaPool:
    """`servers`: server_id -> replica. `balancer`: the object the rollout client leases
    from (anything with `remove_servers(ids)`). `on_pause(bool)` is called around each
    weight sync (the rollout clock stops while the replicas are paused)."""

    def __init__(
        self,
        servers: Mapping[str, Any],
        balancer: Any,
        manager: CheckpointEngineManager,
        *,
        health_timeout_s: float = 30.0,
        on_pause: Callable[[bool], None] | None = None,
    ) -> None:
        if not servers:
            raise ValueError("ReplicaPool: no rollout replicas")
        self.servers: dict[str, Any] = dict(servers)
        self.balancer = balancer
        self.manager = manager
        self.health_timeout_s = health_timeout_s
        self.on_pause = on_pause
        self.removed: dict[str, str] = {}
        self.last_sync: SyncResult | None = None
        self._lock = asyncio.Lock()

    @property
    def server_ids(self) -> list[str]:
        return list(self.servers)

    async def _remove(self, ids: Iterable[str], reason: str | Mapping[str, str]) -> None:
        ids = [i for i in ids if i in self.servers]
        if not ids:
            return
        result = self.balancer.remove_servers(ids)
        if asyncio.iscoroutine(result):  # an async balancer wrapper
            await result
        for i in ids:
            why = reason[i] if isinstance(reason, Mapping) else reason
            self.removed[i] = why
            del self.servers[i]
            logger.warning("rollout replica %s removed: %s", i, why)

    async def sync(self, named_tensors: Callable[[], Iterable], version: int) -> SyncResult:
        """One weight sync to every live replica; replicas that fail it are removed."""
        async with self._lock:
            if not self.servers:
                raise NoReplicasLeft(f"no rollout replica left to sync; removed: {self.removed}")
            if self.on_pause:
                self.on_pause(True)
            try:
                result = await self.manager.sync(named_tensors, version, targets=self.servers)
            finally:
                if self.on_pause:
                    self.on_pause(False)
            self.last_sync = result
            if result.failed:
                await self._remove(list(result.failed), result.failed)
            if not self.servers:
                raise NoReplicasLeft(
                    f"every replica failed the sync to version {version}: {result.failed}"
                )
            return result

    async def _probe(self, server: Any) -> None:
        refresh = getattr(server, "refresh", None)
        if refresh is not None:
            await refresh()
        else:
            _ = server.weight_version

    async def check_health(self) -> list[str]:
        """Probe every replica; remove and return the ones that do not answer."""
        ids = list(self.servers)
        outcomes = await asyncio.gather(
            *(asyncio.wait_for(self._probe(self.servers[i]), self.health_timeout_s) for i in ids),
            return_exceptions=True,
        )
        dead = {
            i: f"health check: {type(o).__name__}: {o}"
            for i, o in zip(ids, outcomes, strict=True)
            if isinstance(o, BaseException)
        }
        await self._remove(list(dead), dead)
        return list(dead)

    async def on_engine_error(self, exc: BaseException) -> bool:
        """For the agent loop: heal the pool after a failed generate; True to retry."""
        await self.check_health()
        return bool(self.servers)

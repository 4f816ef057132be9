"""Hybrid replicas: rollout engines on the trainer's devices that sleep while it trains and
join the balancer only while validation runs.

The validation cycle runs between two global steps, driven by the trainer: its weights
are then the version it has just synced, and it waits for the cycle (its devices serve
the hybrid replicas meanwhile). Phases, in this order, each recorded in `events`:

    TRAIN→ROLLOUT  wake     wake the hybrid replicas (their weights' memory first)
                   sync     the trainer's weights to them, through their own
                            checkpoint-engine manager (abort, release KV, transfer,
                            resume KV, resume)
                   abort_standalone   abort the standalone replicas
                   add      add the hybrid replicas to the balancer
                   resume   resume generation on every replica
    validate       validation (and training rollout) requests spread over all replicas
    ROLLOUT→TRAIN  abort    abort every replica
                   remove   remove the hybrid replicas from the balancer
                   release_kv, sleep   free the hybrid replicas' KV cache, put them to sleep
                   resume_standalone   resume the standalone replicas

Each phase runs on every replica at once, awaited together. The cycle's metrics time the
phases that move memory (`hybrid/wake_s`; `hybrid/sleep_s`: release_kv + sleep) and, where
the replicas report their device's free memory (`device_memory()`), what going to sleep
gave back to the trainer's devices (`hybrid/sleep_freed_gb`, read before release_kv and
after sleep, while every other replica is paused and the trainer waits). `abort` is issued and
`remove` takes effect before any aborted request comes back, so a request interrupted on
a hybrid replica is resumed by the PartialRolloutClient on a standalone one (as after a
weight sync), never re-leased to a replica going to sleep. A hybrid replica that fails a
phase (or dies while serving: the pool's health check, see `ReplicaPool.guests`) is
dropped for the rest of the run; validation goes on without it.

Knows nothing about vLLM or Ray: replicas are `RolloutServer` / `SyncTarget` objects with
`sleep(level)` and `wake_up(tags)` (and, optionally, `status()` and `device_memory()`);
the balancer is the pool's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from offbeat.ckpt_engine import CheckpointEngineManager
from offbeat.core.trainer.replicas import ReplicaPool, call_each, failures

logger = logging.getLogger(__name__)

__all__ = ["CYCLE_PHASES", "HybridReplicas"]

CYCLE_PHASES = (
    "wake",
    "sync",
    "abort_standalone",
    "add",
    "resume",
    "validate",
    "abort",
    "remove",
    "release_kv",
    "sleep",
    "resume_standalone",
)

T = TypeVar("T")


class HybridReplicas:
    """`servers`: hybrid id -> replica, started and awake. `pool`: the standalone replicas
    (and the balancer). `manager`: the hybrid replicas' own checkpoint-engine manager.
    `sleep_level`: 1 frees the KV cache and offloads the weights, 2 frees both (they are
    synced at every wake anyway). `client`: the PartialRolloutClient, whose per-server
    tallies split the cycle's calls and tokens between hybrid and standalone replicas."""

    def __init__(
        self,
        servers: Mapping[str, Any],
        pool: ReplicaPool,
        manager: CheckpointEngineManager,
        *,
        sleep_level: int = 2,
        client: Any = None,
        phase_timeout_s: float = 300.0,
    ) -> None:
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level!r}: expected 1 or 2")
        self.servers: dict[str, Any] = dict(servers)
        self.pool = pool
        self.manager = manager
        self.sleep_level = sleep_level
        self.client = client
        self.phase_timeout_s = phase_timeout_s
        self.events: list[tuple[int | None, str]] = []  # (weight version, phase)
        self.lost: dict[str, str] = {}
        self.cycles = 0

    @property
    def ids(self) -> list[str]:
        return list(self.servers)

    def _note(self, version: int | None, phase: str) -> None:
        self.events.append((version, phase))

    def _drop(self, server_id: str, why: str) -> None:
        if self.servers.pop(server_id, None) is not None:
            self.lost[server_id] = why
            logger.warning("hybrid replica %s dropped: %s", server_id, why)

    def _sync_losses(self) -> None:
        """Take over the guests the pool's health check removed."""
        for i, why in self.pool.lost_guests.items():
            if i in self.servers:
                self._drop(i, why)

    async def _each(
        self,
        version: int | None,
        phase: str,
        servers: Mapping[str, Any],
        call: Callable[[Any], Awaitable[Any]],
    ) -> dict[str, str]:
        """`call` on every replica of `servers` at once; returns id -> why for failures."""
        self._note(version, phase)
        return failures(await call_each(servers, call, self.phase_timeout_s), phase)

    async def _hybrids(self, version: int | None, phase: str, call) -> None:
        for i, why in (await self._each(version, phase, dict(self.servers), call)).items():
            self._drop(i, why)

    async def _standalone(self, version: int, phase: str, call) -> None:
        failed = await self._each(version, phase, dict(self.pool.servers), call)
        if failed:  # a standalone replica that cannot abort or resume is gone: replace it
            await self.pool.remove_dead(failed)

    async def _device_free(self) -> dict[str, int]:
        """id -> free bytes of each hybrid replica's device now, for the replicas that
        report it (`device_memory()`: the device as a whole, every process on it); the
        others, and any that fails to answer, are left out."""
        probes = {i: s for i, s in self.servers.items() if hasattr(s, "device_memory")}
        outcomes = await call_each(probes, lambda s: s.device_memory(), self.phase_timeout_s)
        return {
            i: int(o["free_bytes"])
            for i, o in outcomes.items()
            if isinstance(o, dict) and "free_bytes" in o
        }

    async def asleep_levels(self) -> dict[str, int]:
        """id -> the sleep level each hybrid replica reports now (`status()["asleep_level"]`,
        0: awake), for the replicas that report one; the trainer reads it while it trains."""
        probes = {i: s for i, s in self.servers.items() if hasattr(s, "status")}
        outcomes = await call_each(probes, lambda s: s.status(), self.phase_timeout_s)
        return {
            i: int(o["asleep_level"])
            for i, o in outcomes.items()
            if isinstance(o, dict) and "asleep_level" in o
        }

    async def put_to_sleep(self) -> None:
        """The end of the two-phase start: every hybrid replica, initialised, sleeps."""
        await self._hybrids(None, "sleep", lambda s: s.sleep(self.sleep_level))

    def _tally(self) -> tuple[dict[str, int], dict[str, int]]:
        if self.client is None:
            return {}, {}
        return dict(self.client.served_calls), dict(self.client.served_tokens)

    def _served(self, before, joined: Iterable[str]) -> dict[str, float]:
        """Calls and tokens served during the cycle, split by kind; each call once."""
        if self.client is None:
            return {}
        after = self._tally()
        hybrid = set(joined)
        out = {}
        for n, what in enumerate(("calls", "tokens")):
            delta = {k: v - before[n].get(k, 0) for k, v in after[n].items()}
            h = sum(v for k, v in delta.items() if k in hybrid)
            out[f"hybrid/served_{what}"] = float(h)
            out[f"hybrid/standalone_served_{what}"] = float(sum(delta.values()) - h)
        return out

    async def cycle(
        self,
        named_tensors: Callable[[], Iterable],
        version: int,
        validate: Callable[[], Awaitable[T]],
    ) -> tuple[T, dict[str, float]]:
        """One validation cycle at weight `version` (the trainer's weights now); returns
        what `validate()` returned and the cycle's metrics."""
        self._sync_losses()
        t0 = time.perf_counter()
        # ---- TRAIN→ROLLOUT
        await self._hybrids(version, "wake", lambda s: s.wake_up(["weights"]))
        wake_s = time.perf_counter() - t0
        self._note(version, "sync")
        result = await self.manager.sync(named_tensors, version, targets=dict(self.servers))
        for i, why in result.failed.items():
            self._drop(i, why)
        joined = {i: s for i, s in self.servers.items() if i in result.succeeded}
        await self._standalone(version, "abort_standalone", lambda s: s.abort_all())
        self._note(version, "add")
        await self.pool.add_guests(joined)
        every = {**self.pool.servers, **joined}
        failed = await self._each(version, "resume", every, lambda s: s.resume())
        t_ready = time.perf_counter()
        before = self._tally()
        try:
            self._note(version, "validate")
            out = await validate()
        finally:
            t_val = time.perf_counter()
            # ---- ROLLOUT→TRAIN
            self._sync_losses()
            self._note(version, "abort")
            guests = [i for i in joined if i in self.servers]
            every = {**self.pool.servers, **{i: self.servers[i] for i in guests}}
            aborts = {
                i: asyncio.ensure_future(asyncio.wait_for(s.abort_all(), self.phase_timeout_s))
                for i, s in every.items()
            }
            # No await since the aborts were issued: the hybrids leave the balancer before
            # any aborted request can come back for a new lease.
            self._note(version, "remove")
            self.pool.remove_guests(list(joined))
            if aborts:
                await asyncio.wait(list(aborts.values()))
            for i, task in aborts.items():
                if task.exception() is not None:
                    failed[i] = f"abort: {type(task.exception()).__name__}: {task.exception()}"
            for i in [i for i in failed if i in self.servers]:
                self._drop(i, failed.pop(i))
            # Every replica is paused and the trainer waits: the device's free memory
            # moves only with what the hybrids release (the reads are not timed).
            t_probe = time.perf_counter()
            awake_free = await self._device_free()
            t_sleep = time.perf_counter()
            await self._hybrids(version, "release_kv", lambda s: s.release_kv_cache())
            await self._hybrids(version, "sleep", lambda s: s.sleep(self.sleep_level))
            sleep_s = time.perf_counter() - t_sleep
            asleep_free = await self._device_free()
            probe_s = time.perf_counter() - t_probe - sleep_s
            if failed:
                await self.pool.remove_dead(
                    {i: w for i, w in failed.items() if i in self.pool.servers}
                )
            await self._standalone(version, "resume_standalone", lambda s: s.resume())
            self.cycles += 1
        t_end = time.perf_counter()
        metrics = {
            "hybrid/replicas": float(len(joined)),
            "hybrid/lost_total": float(len(self.lost)),
            "hybrid/enter_s": t_ready - t0,
            "hybrid/validate_s": t_val - t_ready,
            "hybrid/exit_s": t_end - t_val - probe_s,
            "hybrid/sync_s": sum(result.phase_s.values()),
            "hybrid/wake_s": wake_s,
            "hybrid/sleep_s": sleep_s,
            **self._served(before, joined),
        }
        both = [i for i in awake_free if i in asleep_free]
        if both:  # summed: each hybrid replica sits on its own trainer rank's device
            freed = sum(asleep_free[i] - awake_free[i] for i in both)
            metrics["hybrid/sleep_freed_gb"] = freed / 1e9
            metrics["hybrid/asleep_free_gb"] = sum(asleep_free[i] for i in both) / 1e9
        return out, metrics

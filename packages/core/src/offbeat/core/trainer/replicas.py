"""The pool of rollout replicas as the trainer sees it: weight syncs, failures, replacements.

Knows nothing about what runs inside a replica (any object implementing `RolloutServer`
and `SyncTarget`, local or a Ray actor proxy), how bytes travel (the
CheckpointEngineManager's backend) or how a replica is started (a `Replacement` callable
the job gives). A replica that dies, stops answering, or fails a weight sync is removed
from the balancer, so new and resumed requests go elsewhere; with a `Replacement`, a new
replica is started in its place (bounded attempts, doubling backoff) and joins the
balancer only once it holds the trainer's weight version: at the next weight sync, or
earlier through `admit` while the trainer waits (for a batch, or for a validation) with
its weights still the version it last synced. A sync that loses every replica waits for
the replacement and brings it to the version, so no sync returns with nothing to serve.

Guests are replicas the pool does not sync, only watches while they are in the balancer
(hybrid replicas during validation, `offbeat.core.trainer.hybrid`): a dead guest is
removed from the balancer and reported in `lost_guests`, never replaced here.

A replacement's start is an exempt phase of the run's progress registry (the stall
watchdog holds meanwhile; `replica_ready_timeout_s` bounds it, `offbeat.core.progress`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from offbeat.ckpt_engine import CheckpointEngineManager, SyncResult
from offbeat.core import progress

logger = logging.getLogger(__name__)

__all__ = ["NoReplicasLeft", "Replacement", "ReplicaPool", "call_each", "failures"]


class NoReplicasLeft(RuntimeError):
    """Every rollout replica was removed (and none is being replaced)."""


@dataclass
class Replacement:
    """How the pool replaces a removed replica. `start(dead_id, new_id, dead)` frees what
    the dead replica held (e.g. kills its actor; `dead` is None when that is done), starts
    `new_id` in its place and returns it once it answers; it raises when the start failed.
    A replica slot gets up to `attempts` failed starts (or failed first syncs) in a row:
    the first start at once, retry k after `backoff_s * 2**(k-1)` seconds; a replacement
    that joins resets the count. 0 attempts: dead replicas are only removed."""

    start: Callable[[str, str, Any], Awaitable[Any]]
    attempts: int = 3
    backoff_s: float = 5.0


def _merged(a: SyncResult, b: SyncResult) -> SyncResult:
    """Two syncs to one version as one result (phase times and bytes add up)."""
    phase_s = dict(a.phase_s)
    for k, v in b.phase_s.items():
        phase_s[k] = phase_s.get(k, 0.0) + v
    return SyncResult(
        a.version,
        succeeded=[*a.succeeded, *(i for i in b.succeeded if i not in a.succeeded)],
        failed={**a.failed, **b.failed},
        phase_s=phase_s,
        phase_spans={**b.phase_spans, **a.phase_spans},
        replica_spans={**a.replica_spans, **b.replica_spans},
        bytes=a.bytes + b.bytes,
        buckets=a.buckets + b.buckets,
    )


async def call_each(
    servers: Mapping[str, Any], call: Callable[[Any], Awaitable[Any]], timeout_s: float | None
) -> dict[str, Any]:
    """`call(server)` on every one of `servers` at once, each within `timeout_s`: id -> its
    result, or the exception it raised (a timeout included)."""
    ids = list(servers)
    outcomes = await asyncio.gather(
        *(asyncio.wait_for(call(servers[i]), timeout_s) for i in ids), return_exceptions=True
    )
    return dict(zip(ids, outcomes, strict=True))


def failures(outcomes: Mapping[str, Any], what: str) -> dict[str, str]:
    """id -> "<what>: <error>" for the outcomes of `call_each` that are errors."""
    return {
        i: f"{what}: {type(o).__name__}: {o}"
        for i, o in outcomes.items()
        if isinstance(o, BaseException)
    }


def _base_id(server_id: str) -> str:
    return re.sub(r"-r\d+$", "", server_id)


class ReplicaPool:
    """`servers`: server_id -> replica. `balancer`: the object the rollout client leases
    from (anything with `add_servers(mapping)` and `remove_servers(ids)`). `on_pause(bool)`
    is called around each weight sync (the rollout clock stops while the replicas are
    paused). `replacement`: start new replicas for removed ones (None: only remove)."""

    def __init__(
        self,
        servers: Mapping[str, Any],
        balancer: Any,
        manager: CheckpointEngineManager,
        *,
        health_timeout_s: float = 30.0,
        on_pause: Callable[[bool], None] | None = None,
        replacement: Replacement | None = None,
    ) -> None:
        if not servers:
            raise ValueError("ReplicaPool: no rollout replicas")
        self.servers: dict[str, Any] = dict(servers)
        self.balancer = balancer
        self.manager = manager
        if manager is not None and manager.health_probe is None:
            # A replica whose engine died while nothing was generating is dropped from a
            # sync as soon as this probe fails, not after the receiver's connect timeout.
            manager.health_probe = self._probe
        self.health_timeout_s = health_timeout_s
        self.on_pause = on_pause
        self.replacement = replacement
        self.removed: dict[str, str] = {}
        self.last_sync: SyncResult | None = None
        self._lock = asyncio.Lock()
        # Replacements: being started (dead id -> task), started and waiting for weights
        # (new id -> replica), and the history (dead id -> new id; dead id -> why not).
        self.replacing: dict[str, asyncio.Task] = {}
        self.joining: dict[str, Any] = {}
        # Taken from `joining` by the sync (or admission) now bringing them to the weight
        # version: still on their way, so an engine error meanwhile is worth a retry.
        self.admitting: dict[str, Any] = {}
        self.replaced: dict[str, str] = {}
        self.gave_up: dict[str, str] = {}
        self.started: dict[str, Any] = {}  # every replica the pool started (to shut down)
        self._generation: dict[str, int] = {}  # base id -> replacements started for it
        self._failures: dict[str, int] = {}  # base id -> failed attempts since one joined
        self.guests: dict[str, Any] = {}
        self.lost_guests: dict[str, str] = {}

    @property
    def server_ids(self) -> list[str]:
        return list(self.servers)

    async def _balancer(self, method: str, arg: Any) -> Any:
        result = getattr(self.balancer, method)(arg)
        if asyncio.iscoroutine(result):  # an async balancer wrapper
            result = await result
        return result

    async def _remove(self, ids: Iterable[str], reason: str | Mapping[str, str]) -> None:
        ids = [i for i in ids if i in self.servers or i in self.guests]
        if not ids:
            return
        await self._balancer("remove_servers", ids)
        for i in ids:
            why = reason[i] if isinstance(reason, Mapping) else reason
            if i in self.guests:
                del self.guests[i]
                self.lost_guests[i] = why
                logger.warning("hybrid replica %s removed: %s", i, why)
                continue
            self.removed[i] = why
            dead = self.servers.pop(i)
            logger.warning("rollout replica %s removed: %s", i, why)
            self._replace(i, dead)

    async def remove_dead(self, reasons: Mapping[str, str]) -> None:
        """Remove the replicas named in `reasons` (id -> why), replacing each."""
        await self._remove(list(reasons), reasons)

    # ---- replacements --------------------------------------------------------------------
    def _replace(self, dead_id: str, dead: Any) -> None:
        r = self.replacement
        if r is None or r.attempts <= 0 or dead_id in self.replacing:
            return
        self.replacing[dead_id] = asyncio.create_task(
            self._start_replacement(dead_id, dead, r), name=f"replace-{dead_id}"
        )

    async def _start_replacement(self, dead_id: str, dead: Any, r: Replacement) -> None:
        base = _base_id(dead_id)
        errors: list[str] = []
        try:
            while (failures := self._failures.get(base, 0)) < r.attempts:
                if failures:
                    await asyncio.sleep(r.backoff_s * 2 ** (failures - 1))
                n = self._generation[base] = self._generation.get(base, 0) + 1
                new_id = f"{base}-r{n}"
                try:
                    with progress.exempt(f"replica replacement {new_id}"):
                        server = await r.start(dead_id, new_id, dead)
                except Exception as e:
                    self._failures[base] = failures + 1
                    errors.append(f"{new_id}: {type(e).__name__}: {e}")
                    logger.warning("replacement %s for %s failed: %s", new_id, dead_id, e)
                    dead = None  # what the dead replica held is freed already
                    continue
                self.started[new_id] = server
                self.joining[new_id] = server
                self.replaced[dead_id] = new_id
                logger.warning("replacement %s for %s started; it joins at the trainer's "
                               "weight version", new_id, dead_id)  # fmt: skip
                return
            self.gave_up[dead_id] = "; ".join(errors) or "no attempts left"
            logger.error("no replacement for %s after %d attempts: %s", dead_id, r.attempts, errors)
        finally:
            self.replacing.pop(dead_id, None)

    def _failed_to_join(self, server_id: str, server: Any, why: str) -> None:
        """A replacement that failed its weight sync: a failed attempt; try again."""
        self.removed[server_id] = why
        base = _base_id(server_id)
        self._failures[base] = self._failures.get(base, 0) + 1
        self._replace(server_id, server)

    async def _wait_for_replacement(self) -> None:
        """Until a replacement is waiting to join, or none is being started."""
        while not self.joining and self.replacing:
            await asyncio.wait(list(self.replacing.values()), return_when=asyncio.FIRST_COMPLETED)

    @contextlib.contextmanager
    def _in_transit(self, joiners: dict[str, Any]):
        """While `joiners`, taken from `joining`, are synced: they are in `admitting` until
        they joined (`servers`) or failed (`replacing` again)."""
        self.admitting = joiners
        try:
            yield
        finally:
            self.admitting = {}

    def _joined(self, result: SyncResult, joiners: Mapping[str, Any]) -> dict[str, Any]:
        return {i: s for i, s in joiners.items() if i in result.succeeded}

    async def _add(self, joined: Mapping[str, Any]) -> None:
        if joined:
            self.servers.update(joined)
            for i in joined:
                self._failures.pop(_base_id(i), None)
            await self._balancer("add_servers", dict(joined))

    async def admit(self, named_tensors: Callable[[], Iterable], version: int) -> list[str]:
        """Bring the replacements waiting to join to weight `version` (the trainer's weights
        must be that version now) and add them to the balancer; returns their ids."""
        async with self._lock:
            result = await self._admit(named_tensors, version)
            return [] if result is None else list(result.succeeded)

    async def _admit(
        self, named_tensors: Callable[[], Iterable], version: int
    ) -> SyncResult | None:
        """`admit` under the lock: the SyncResult of the joiners (None: nobody waited)."""
        joiners, self.joining = self.joining, {}
        if not joiners:
            return None
        with self._in_transit(joiners):
            stale = {i: s for i, s in joiners.items() if s.weight_version != version}
            joined = {i: s for i, s in joiners.items() if i not in stale}
            result = SyncResult(version, succeeded=list(joined))
            if stale:
                synced = await self.manager.sync(named_tensors, version, targets=stale)
                result = _merged(result, synced)
                joined.update(self._joined(synced, stale))
                for i, why in synced.failed.items():
                    self._failed_to_join(i, stale[i], why)
            await self._add(joined)
        return result

    # ---- weight sync ---------------------------------------------------------------------
    async def sync(self, named_tensors: Callable[[], Iterable], version: int) -> SyncResult:
        """One weight sync to every live replica and to the replacements waiting to join
        (which then join); replicas that fail it are removed (and replaced)."""
        async with self._lock:
            if not self.servers:
                await self._wait_for_replacement()
            joiners, self.joining = self.joining, {}
            if not self.servers and not joiners:
                raise NoReplicasLeft(
                    f"no rollout replica left to sync; removed: {self.removed}, "
                    f"replacements given up: {self.gave_up}"
                )
            with self._in_transit(joiners):
                if self.on_pause:
                    self.on_pause(True)
                try:
                    targets = {**self.servers, **joiners}
                    result = await self.manager.sync(named_tensors, version, targets=targets)
                finally:
                    if self.on_pause:
                        self.on_pause(False)
                self.last_sync = result
                failed = dict(result.failed)
                for i in [i for i in failed if i in joiners]:
                    self._failed_to_join(i, joiners[i], failed.pop(i))
                await self._add(self._joined(result, joiners))
            if failed:
                await self._remove(list(failed), await self._diagnosed(failed, targets))
            # Every replica was lost in this sync (it failed it, or a health check removed
            # it meanwhile) but a replacement is on its way: wait for it and bring it to
            # `version` now. Otherwise the trainer goes on with no replica at all, and what
            # it awaits next (this version's validation, a batch already complete) waits
            # for a replica that only a later sync would admit: a deadlock.
            while not self.servers and (self.replacing or self.joining):
                await self._wait_for_replacement()
                more = await self._admit(named_tensors, version)
                if more is not None:
                    result = _merged(result, more)
            if not self.servers:
                raise NoReplicasLeft(
                    f"every replica failed the sync to version {version}: {result.failed}; "
                    f"replacements given up: {self.gave_up}"
                )
            self.last_sync = result
            return result

    # ---- guests (hybrid replicas while they serve) ---------------------------------------
    async def add_guests(self, guests: Mapping[str, Any]) -> None:
        self.guests.update(guests)
        await self._balancer("add_servers", dict(guests))

    def remove_guests(self, ids: Iterable[str]) -> None:
        """Stop routing to the guests `ids` now (synchronous: no request can lease one of
        them after this returns)."""
        ids = [i for i in ids if i in self.guests]
        self.balancer.remove_servers(ids)  # AsyncLoadBalancer and LoadBalancer: synchronous
        for i in ids:
            del self.guests[i]

    # ---- health --------------------------------------------------------------------------
    async def _probe(self, server: Any) -> None:
        refresh = getattr(server, "refresh", None)
        if refresh is not None:
            await refresh()
        else:
            _ = server.weight_version

    async def _unhealthy(self, servers: Mapping[str, Any]) -> dict[str, str]:
        """Probe each of `servers` at once: id -> "health check: <error>" for the ones
        that do not answer."""
        return failures(
            await call_each(servers, self._probe, self.health_timeout_s), "health check"
        )

    async def _diagnosed(
        self, failed: Mapping[str, str], targets: Mapping[str, Any]
    ) -> dict[str, str]:
        """Why each replica that failed a sync is removed: a replica whose engine died
        while nothing was generating fails the sync first (its receiver never connects,
        and the sync only knows that); a health probe then names the cause (e.g.
        EngineDeadError), the sync's reason beside it. A replica that answers the probe
        keeps the sync's reason."""
        # a replica the sync dropped for its probe is not probed again
        probe = [i for i, why in failed.items() if i in targets and "health check:" not in why]
        dead = await self._unhealthy({i: targets[i] for i in probe})
        return {
            i: f"{dead[i]} (the sync: {why})" if i in dead else why for i, why in failed.items()
        }

    async def check_health(self) -> list[str]:
        """Probe every replica and guest; remove (and replace) and return the ones that do
        not answer."""
        dead = await self._unhealthy({**self.servers, **self.guests})
        await self._remove(list(dead), dead)
        return list(dead)

    async def on_engine_error(self, exc: BaseException) -> bool:
        """For the agent loop: heal the pool after a failed generate; True to retry (a
        replacement on its way counts: the retry waits in the balancer for it). One being
        synced to join counts too: it is in none of `servers`, `joining` or `replacing`
        then, and a False here fails the request's group for nothing."""
        await self.check_health()
        return bool(self.servers or self.joining or self.admitting or self.replacing)

    def counts(self) -> dict[str, float]:
        return {
            "replicas/standalone": float(len(self.servers)),
            "replicas/removed_total": float(len(self.removed)),
            "replicas/replaced_total": float(len(self.replaced)),
        }

    async def close(self) -> None:
        """Stop the replacements still being started."""
        tasks = list(self.replacing.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

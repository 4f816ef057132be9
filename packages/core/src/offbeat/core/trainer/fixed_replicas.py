"""Replicas that serve at fixed weights (OPD teachers, GenRM judges): failures and
replacements, with no weight sync.

A caller that leased one of them from the balancer and saw its call fail (an error, a
timeout) reports it with `failed(server_id, exc)`. The replica is probed once (callers
that fail on it meanwhile share that probe); one that answers stays (the error was the
call's). One that does not is removed from the balancer, so no new call leases it, and
with a `Replacement` a new replica is started in its place (bounded attempts, doubling
backoff, `offbeat.core.trainer.replicas.Replacement`). It joins the balancer as soon as it
answers: there is no weight version to wait for. A retry that leases from an
`AsyncLoadBalancer` waits there for it; `wait_available()` waits until a replica serves
or none is on its way.

A replacement's start is an exempt phase of the run's progress registry (the stall
watchdog holds meanwhile). Knows nothing of what the replicas serve nor how they are
started (the `Replacement` the job gives).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from offbeat.core import progress
from offbeat.core.trainer.replicas import Replacement, _base_id

logger = logging.getLogger(__name__)

__all__ = ["FixedReplicas"]


class FixedReplicas:
    """`servers`: server_id -> replica (its async `refresh()` is the probe; one without
    is never removed), all in `balancer` (`add_servers(mapping)`,
    `remove_servers(ids)`). `kind` names them in the log ("teacher math", "judge")."""

    def __init__(
        self,
        servers: Mapping[str, Any],
        balancer: Any,
        *,
        replacement: Replacement | None = None,
        health_timeout_s: float = 30.0,
        kind: str = "replica",
    ) -> None:
        self.servers: dict[str, Any] = dict(servers)
        self.balancer = balancer
        self.replacement = replacement
        self.health_timeout_s = health_timeout_s
        self.kind = kind
        self.removed: dict[str, str] = {}  # dead id -> why
        self.replaced: dict[str, str] = {}  # dead id -> the replica that took its place
        self.gave_up: dict[str, str] = {}  # dead id -> why no replacement joined
        self.replacing: dict[str, asyncio.Task] = {}
        self.started: dict[str, Any] = {}  # every replacement started (to shut down)
        self._probes: dict[str, asyncio.Future] = {}
        self._generation: dict[str, int] = {}
        self._changed = asyncio.Event()
        self.closed = False  # after `close`: failures are not acted on, nothing is started

    @property
    def available(self) -> bool:
        """A replica serves, or one is being started: a retry can be served."""
        return bool(self.servers or self.replacing)

    async def failed(self, server_id: str | None, exc: BaseException | None = None) -> bool:
        """A call on `server_id` failed with `exc`: probe it; remove (and replace) it when
        it does not answer. Returns `available`. After `close` (the run is shutting its
        replicas down, so calls fail on them) it does nothing and returns False."""
        if self.closed:
            return False
        if server_id is not None and server_id in self.servers:
            probe = self._probes.get(server_id)
            if probe is None:
                probe = self._probes[server_id] = asyncio.ensure_future(self._check(server_id, exc))
            with contextlib.suppress(Exception):
                await asyncio.shield(probe)
        return self.available

    async def _check(self, server_id: str, exc: BaseException | None) -> None:
        try:
            server = self.servers[server_id]
            try:
                await asyncio.wait_for(self._probe(server), self.health_timeout_s)
                return  # it answers: the call's own error
            except Exception as e:
                why = f"{type(exc).__name__}: {exc}" if exc is not None else "failed call"
                why += f"; health check: {type(e).__name__}: {e}"
            self._remove(server_id, why)
        finally:
            self._probes.pop(server_id, None)

    @staticmethod
    async def _probe(server: Any) -> None:
        refresh = getattr(server, "refresh", None)  # none: it cannot be probed, and stays
        if refresh is not None:
            await refresh()

    def _remove(self, server_id: str, why: str) -> None:
        dead = self.servers.pop(server_id, None)
        if dead is None:
            return
        self.balancer.remove_servers([server_id])
        self.removed[server_id] = why
        logger.warning("%s %s removed: %s", self.kind, server_id, why)
        r = self.replacement
        if r is not None and r.attempts > 0 and server_id not in self.replacing and not self.closed:
            self.replacing[server_id] = asyncio.create_task(
                self._start_replacement(server_id, dead, r), name=f"replace-{server_id}"
            )
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _start_replacement(self, dead_id: str, dead: Any, r: Replacement) -> None:
        base = _base_id(dead_id)
        errors: list[str] = []
        try:
            for attempt in range(r.attempts):
                if attempt:
                    await asyncio.sleep(r.backoff_s * 2 ** (attempt - 1))
                n = self._generation[base] = self._generation.get(base, 0) + 1
                new_id = f"{base}-r{n}"
                try:
                    with progress.exempt(f"{self.kind} replacement {new_id}"):
                        server = await r.start(dead_id, new_id, dead)
                except Exception as e:
                    errors.append(f"{new_id}: {type(e).__name__}: {e}")
                    logger.warning("%s replacement %s for %s failed: %s", self.kind, new_id,
                                   dead_id, e)  # fmt: skip
                    dead = None  # what the dead replica held is freed already
                    continue
                self.started[new_id] = server
                self.servers[new_id] = server
                self.replaced[dead_id] = new_id
                result = self.balancer.add_servers({new_id: server})
                if asyncio.iscoroutine(result):
                    await result
                logger.warning("%s replacement %s for %s serves", self.kind, new_id, dead_id)
                return
            self.gave_up[dead_id] = "; ".join(errors) or "no attempts left"
            logger.error("no %s replacement for %s after %d attempts: %s", self.kind, dead_id,
                         r.attempts, errors)  # fmt: skip
        finally:
            self.replacing.pop(dead_id, None)
            self._notify()

    async def wait_available(self) -> bool:
        """Until a replica serves or none is on its way; True when one serves."""
        while not self.servers and self.replacing and not self.closed:
            await self._changed.wait()
        return bool(self.servers)

    def summary(self) -> dict[str, Any]:
        return {
            "removed": dict(self.removed),
            "replaced": dict(self.replaced),
            "gave_up": dict(self.gave_up),
        }

    async def close(self) -> None:
        """Stop the replacements still being started; act on no failure from now on."""
        self.closed = True
        tasks = [*self.replacing.values(), *self._probes.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        self._notify()  # a `wait_available` returns

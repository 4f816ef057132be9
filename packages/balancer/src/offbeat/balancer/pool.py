"""The server pool: incarnations, their in-flight counts and a least-loaded index.

Knows nothing about requests, stickiness or locking: the `LoadBalancer` holds the lock and
calls in. Policies read it (`active`, `least_loaded`, `rng`) to choose a server.

The least-loaded index is a binary heap of `(inflight, seq, server)` entries with lazy
invalidation: a server's entry is valid only while its `seq` matches, so changing a count is
one push and stale entries are dropped when they surface (or by a rebuild when the heap grows
past twice the pool). `seq` increases on every push, so among servers of equal load the one
that waited longest wins: ties rotate instead of always going to the first server.
"""

from __future__ import annotations

import itertools
import random
from heapq import heapify, heappop, heappush
from typing import Any

__all__ = ["Server", "ServerPool"]

_MISSING = object()


class Server:
    """One incarnation of a server. Removing and re-adding an id makes a new incarnation.

    Read-only for policies: `id`, `handle`, `inflight` (sum of the costs of its open leases),
    `incarnation`, `healthy`, `draining`, `removed` and `accepting` (takes new requests).
    """

    __slots__ = (
        "accepting",
        "draining",
        "handle",
        "healthy",
        "id",
        "incarnation",
        "inflight",
        "pool",
        "removed",
        "seq",
    )

    def __init__(self, pool: ServerPool, server_id: str, handle: Any, incarnation: int) -> None:
        self.pool = pool
        self.id = server_id
        self.handle = handle
        self.incarnation = incarnation
        self.inflight = 0
        self.healthy = True
        self.draining = False
        self.removed = False
        self.accepting = True
        self.seq = -1  # seq of this server's valid heap entry; -1 when it has none

    def __repr__(self) -> str:
        state = (
            "removed"
            if self.removed
            else "draining"
            if self.draining
            else "unhealthy"
            if not self.healthy
            else "active"
        )
        return f"Server({self.id!r}, inflight={self.inflight}, #{self.incarnation}, {state})"


class ServerPool:
    """The servers of one balancer, each with its exact in-flight count."""

    def __init__(self, *, seed: int | None = None, max_inflight: int | None = None) -> None:
        if max_inflight is not None and (type(max_inflight) is not int or max_inflight < 1):
            raise ValueError(f"max_inflight must be a positive int or None, got {max_inflight!r}")
        self.rng = random.Random(seed)
        self.max_inflight = max_inflight
        self.version = 0  # bumped whenever the set of accepting servers changes
        self._servers: dict[str, Server] = {}  # current incarnations, in registration order
        self._heap: list[tuple[int, int, Server]] = []
        self._heap_limit = 64
        self._seq = itertools.count()
        self._incarnations = itertools.count(1)
        self._active: tuple[Server, ...] | None = ()
        self._seeded = seed is not None

    # ---- reading (policies) -------------------------------------------------------------
    @property
    def active(self) -> tuple[Server, ...]:
        """Servers that accept new requests, in registration order."""
        active = self._active
        if active is None:
            active = self._active = tuple(s for s in self._servers.values() if s.accepting)
        return active

    def get(self, server_id: str) -> Server | None:
        """The current incarnation of `server_id` (active, draining or unhealthy), or None."""
        return self._servers.get(server_id)

    def all(self) -> tuple[Server, ...]:
        """Every current incarnation (active, draining, unhealthy), in registration order."""
        return tuple(self._servers.values())

    def has_room(self, server: Server, cost: int) -> bool:
        """Whether `server` accepts a request of `cost` now."""
        cap = self.max_inflight
        return server.accepting and (cap is None or server.inflight + cost <= cap)

    def least_loaded(self, cost: int = 1) -> Server | None:
        """The accepting server with the fewest in-flight cost (ties rotate), or None."""
        heap = self._heap
        while heap:
            load, seq, srv = heap[0]
            if seq == srv.seq:
                cap = self.max_inflight
                if cap is not None and load + cost > cap:
                    return None
                return srv
            heappop(heap)
        return None

    # ---- counting (the balancer, under its lock) ----------------------------------------
    # The balancer changes `inflight` and pushes the new heap entry inline (its hot path);
    # these two are that same bookkeeping for everything else.
    def push(self, srv: Server) -> None:
        """Index `srv` at its current load (it must be accepting)."""
        heap = self._heap
        seq = srv.seq = next(self._seq)
        heappush(heap, (srv.inflight, seq, srv))
        if len(heap) > self._heap_limit:
            self._rebuild()

    def drop_if_drained(self, srv: Server) -> bool:
        """Drop a draining server whose count reached 0. True if it was dropped."""
        if srv.draining and srv.inflight <= 0 and not srv.removed:
            self._drop(srv)
            return True
        return False

    # ---- membership (the balancer, under its lock) --------------------------------------
    def add(self, server_id: str, handle: Any = _MISSING) -> Server:
        """Register `server_id`, or bring it back: an active or draining id keeps its count."""
        if not isinstance(server_id, str):
            raise TypeError(
                f"server ids must be str, got {server_id!r} ({type(server_id).__name__})"
            )
        srv = self._servers.get(server_id)
        if srv is None:
            srv = Server(
                self, server_id, None if handle is _MISSING else handle, next(self._incarnations)
            )
            self._servers[server_id] = srv
        else:
            if handle is not _MISSING:
                srv.handle = handle
            srv.draining = False
        self._refresh(srv)
        return srv

    def remove(self, server_id: str, *, drain: bool) -> bool:
        srv = self._servers.get(server_id)
        if srv is None:
            return False
        if drain and srv.inflight > 0:
            srv.draining = True
            self._refresh(srv)
        else:
            self._drop(srv)
        return True

    def set_healthy(self, server_id: str, healthy: bool) -> Server | None:
        srv = self._servers.get(server_id)
        if srv is not None:
            srv.healthy = healthy
            self._refresh(srv)
        return srv

    def shuffle_ties(self) -> None:
        """Randomise the order among equal loads (seeded): used once servers are added."""
        if not self._seeded:
            return
        entries = [s for s in self._servers.values() if s.seq >= 0]
        self.rng.shuffle(entries)
        for s in entries:
            s.seq = next(self._seq)
        self._rebuild()

    # ---- internals -----------------------------------------------------------------------
    def _drop(self, srv: Server) -> None:
        srv.removed = True
        srv.draining = False
        del self._servers[srv.id]
        self._refresh(srv)

    def _refresh(self, srv: Server) -> None:
        accepting = srv.healthy and not srv.draining and not srv.removed
        if accepting != srv.accepting or (accepting and srv.seq < 0):
            srv.accepting = accepting
            self._active = None
            self.version += 1
            if accepting:
                seq = srv.seq = next(self._seq)
                heappush(self._heap, (srv.inflight, seq, srv))
            else:
                srv.seq = -1
            self._heap_limit = 2 * len(self._servers) + 64
            if len(self._heap) > self._heap_limit:
                self._rebuild()

    def _rebuild(self) -> None:
        heap = [(s.inflight, s.seq, s) for s in self._servers.values() if s.seq >= 0]
        heapify(heap)
        self._heap = heap

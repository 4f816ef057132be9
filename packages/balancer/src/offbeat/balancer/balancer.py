"""LoadBalancer: leases on server replicas, sticky sessions, drain and health, thread-safe.

Knows nothing about what a server is or how to call it (a handle is opaque: a URL, a Ray
actor, a client) and nothing about asyncio or Ray: those are thin wrappers in `aio` and
`actor`. One lock guards all state; every operation under it is O(1) or O(log N).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from heapq import heappush, heapreplace
from typing import Any

from offbeat.balancer.lease import Lease, NoServerAvailable
from offbeat.balancer.policies import LeastInflight, Policy, make_policy
from offbeat.balancer.pool import Server, ServerPool

__all__ = ["LoadBalancer"]


def _items(servers: Mapping[str, Any] | Iterable[str] | None) -> list[tuple[str, Any]]:
    """(id, handle) pairs from a mapping; (id, None) from an iterable of ids."""
    if servers is None:
        return []
    if isinstance(servers, str):
        raise TypeError(
            f"servers must be a mapping id -> handle or an iterable of ids, got the str "
            f"{servers!r}; wrap a single id in a list"
        )
    if isinstance(servers, Mapping):
        return list(servers.items())
    return [(sid, _ID_ONLY) for sid in servers]


_ID_ONLY = object()  # re-adding by id alone keeps the current handle (None for a new server)


class LoadBalancer:
    """Routes requests to server replicas by policy; counts every open lease exactly.

    `servers`: a mapping server_id -> handle, or an iterable of ids (handle None).
    `policy`: a registered name (`available_policies()`) or a `Policy` instance.
    `sticky_capacity`: how many request_id -> server entries to remember (LRU; 0 disables).
    `seed`: seeds the policies' randomness and the initial order among equal loads.
    `max_inflight`: optional per-server cap on in-flight cost; a full pool raises
    `NoServerAvailable` (the async wrapper waits instead).
    `sticky_max_imbalance`: optional; a sticky request leaves its server when that server's
    in-flight cost exceeds the least loaded server's by more than this (None: never).
    """

    def __init__(
        self,
        servers: Mapping[str, Any] | Iterable[str] | None = None,
        *,
        policy: str | Policy = "least_inflight",
        sticky_capacity: int = 10_000,
        seed: int | None = None,
        max_inflight: int | None = None,
        sticky_max_imbalance: int | None = None,
    ) -> None:
        if type(sticky_capacity) is not int or sticky_capacity < 0:
            raise ValueError(f"sticky_capacity must be an int >= 0, got {sticky_capacity!r}")
        if sticky_max_imbalance is not None and (
            type(sticky_max_imbalance) is not int or sticky_max_imbalance < 0
        ):
            raise ValueError(
                f"sticky_max_imbalance must be an int >= 0 or None, got {sticky_max_imbalance!r}"
            )
        self._sticky_max_imbalance = sticky_max_imbalance
        self._lock = threading.Lock()
        self._pool = ServerPool(seed=seed, max_inflight=max_inflight)
        self._policy = make_policy(policy)
        self._least_inflight = type(self._policy) is LeastInflight
        self._sticky: OrderedDict[Any, Server] = OrderedDict()
        self._sticky_capacity = sticky_capacity
        self._listeners: list[Callable[[str], None]] = []
        self.add_servers(servers)
        with self._lock:
            self._pool.shuffle_ties()

    # ---- routing --------------------------------------------------------------------------
    def acquire(
        self,
        request_id: Any,
        *,
        group_id: Any = None,
        prompt_ids: Sequence[int] | None = None,
        cost: int = 1,
    ) -> Lease:
        """Route `request_id`; returns a Lease to release when the request is done.

        Raises NoServerAvailable when no server accepts it (none, all draining/unhealthy/full).
        """
        if cost.__class__ is not int or cost < 1:
            raise ValueError(f"cost must be an int >= 1, got {cost!r}")
        lock = self._lock
        lock.acquire()  # explicit acquire/try/finally: measurably cheaper than `with`
        try:
            sticky = self._sticky
            pool = self._pool
            srv = sticky.get(request_id)
            if (
                srv is not None
                and srv.accepting
                and pool.has_room(srv, cost)
                and (self._sticky_max_imbalance is None or self._sticky_fits(srv, cost))
            ):
                sticky.move_to_end(request_id)
            else:
                stale = srv is not None
                if self._least_inflight:  # the default policy, without a call per request
                    srv = pool.least_loaded(cost)
                else:
                    srv = self._policy.select(pool, request_id, group_id, prompt_ids, cost)
                if srv is None:
                    raise NoServerAvailable(self._why_none(cost))
                if self._sticky_capacity:
                    sticky[request_id] = srv
                    if stale:
                        sticky.move_to_end(request_id)
                    elif len(sticky) > self._sticky_capacity:
                        sticky.popitem(last=False)
            # count it and re-index it (pool.push, inlined: this is the hot path)
            load = srv.inflight = srv.inflight + cost
            if srv.seq >= 0:
                heap = pool._heap
                seq = srv.seq = next(pool._seq)
                if heap[0][2] is srv:  # the usual case: the least-loaded server was picked
                    heapreplace(heap, (load, seq, srv))
                else:
                    heappush(heap, (load, seq, srv))
                    if len(heap) > pool._heap_limit:
                        pool._rebuild()
            return Lease(srv, request_id, cost)
        finally:
            lock.release()

    def release(self, lease: Lease) -> bool:
        """End `lease`. True the first time; False for a repeat or if its server was removed."""
        if lease.__class__ is not Lease:
            raise TypeError(f"release() takes a Lease from acquire(), got {lease!r}")
        srv = lease._server
        if srv.pool is not self._pool:
            raise ValueError(f"{lease!r} was not issued by this LoadBalancer")
        lock = self._lock
        lock.acquire()
        try:
            if not lease._open:
                return False
            lease._open = False
            if srv.removed:
                return False
            # uncount it and re-index it (pool.push, inlined)
            load = srv.inflight = srv.inflight - lease.cost
            if srv.seq >= 0:
                pool = self._pool
                heap = pool._heap
                seq = srv.seq = next(pool._seq)
                heappush(heap, (load, seq, srv))
                if len(heap) > pool._heap_limit:
                    pool._rebuild()
            elif srv.draining and load <= 0:
                self._pool.drop_if_drained(srv)
        finally:
            lock.release()
        if self._listeners:
            self._notify("released")
        return True

    # ---- membership and health ------------------------------------------------------------
    def add_servers(self, servers: Mapping[str, Any] | Iterable[str]) -> None:
        """Add servers (mapping id -> handle, or ids). A known id keeps its count and comes
        back from draining; a mapping replaces its handle. A removed id starts a new
        incarnation at 0, which old leases never touch."""
        items = _items(servers)
        if not items:
            return
        with self._lock:
            for sid, handle in items:
                if handle is _ID_ONLY:
                    self._pool.add(sid)
                else:
                    self._pool.add(sid, handle)
        self._notify("added")

    def remove_servers(self, ids: Iterable[str], *, drain: bool = False) -> set[str]:
        """Stop routing to `ids`. drain=False forgets them now (their open leases release as
        no-ops); drain=True keeps counting their open leases and drops each server once its
        count reaches 0. Returns the ids removed or set draining; unknown ids are ignored."""
        if isinstance(ids, str):
            ids = [ids]
        done: set[str] = set()
        with self._lock:
            for sid in ids:
                if self._pool.remove(sid, drain=drain):
                    done.add(sid)
        return done

    def mark_unhealthy(self, server_id: str) -> bool:
        """No new requests (sticky sessions move); open leases release normally.
        Returns False for an unknown id."""
        with self._lock:
            return self._pool.set_healthy(server_id, False) is not None

    def mark_healthy(self, server_id: str) -> bool:
        """Undo `mark_unhealthy`. Returns False for an unknown id."""
        with self._lock:
            known = self._pool.set_healthy(server_id, True) is not None
        if known:
            self._notify("healthy")
        return known

    # ---- reading --------------------------------------------------------------------------
    def inflight(self, server_id: str) -> int:
        """Sum of the costs of open leases on the current incarnation; 0 for unknown ids."""
        srv = self._pool.get(server_id)
        return srv.inflight if srv is not None else 0

    def servers(self) -> list[str]:
        """Ids that accept new requests, in registration order."""
        with self._lock:
            return [s.id for s in self._pool.active]

    def status(self) -> dict[str, Any]:
        """{"servers": {id: inflight}, "total_inflight", "active", "draining", "unhealthy"}."""
        with self._lock:
            every = self._pool.all()
            counts = {s.id: s.inflight for s in every}
            return {
                "servers": counts,
                "total_inflight": sum(counts.values()),
                "active": [s.id for s in every if s.accepting],
                "draining": [s.id for s in every if s.draining],
                "unhealthy": [s.id for s in every if not s.healthy],
            }

    def clear_sticky(self) -> int:
        """Forget every sticky session; returns how many entries were cleared."""
        with self._lock:
            n = len(self._sticky)
            self._sticky.clear()
            return n

    @property
    def policy(self) -> Policy:
        return self._policy

    # ---- wake-ups (used by the async wrapper) --------------------------------------------
    def add_listener(self, callback: Callable[[str], None]) -> None:
        """Call `callback(kind)` (outside the lock, in the calling thread) whenever capacity may
        have appeared: kind is "added" (servers added), "healthy" or "released" (a lease)."""
        with self._lock:
            self._listeners = [*self._listeners, callback]

    def remove_listener(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            self._listeners = [cb for cb in self._listeners if cb != callback]

    def _notify(self, kind: str) -> None:
        for cb in self._listeners:  # a copy-on-write list: safe to iterate without the lock
            cb(kind)

    def _sticky_fits(self, srv: Server, cost: int) -> bool:
        """Whether a sticky server is not overloaded beyond `sticky_max_imbalance`."""
        least = self._pool.least_loaded(cost)
        return least is None or srv.inflight - least.inflight <= self._sticky_max_imbalance

    def _why_none(self, cost: int) -> str:
        every = self._pool.all()
        if not every:
            return "no servers registered (add_servers first)"
        if not self._pool.active:
            return (
                f"all {len(every)} servers are draining or unhealthy "
                f"({', '.join(repr(s) for s in every[:8])})"
            )
        return (
            f"every accepting server is at max_inflight={self._pool.max_inflight} "
            f"(request cost {cost})"
        )

    def __repr__(self) -> str:
        return (
            f"LoadBalancer(policy={self._policy.name!r}, servers={len(self._pool.all())}, "
            f"active={len(self._pool.active)})"
        )

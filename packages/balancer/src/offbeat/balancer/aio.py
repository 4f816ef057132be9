"""AsyncLoadBalancer: the LoadBalancer for asyncio code, waiting for a server instead of failing.

Knows nothing about routing (the wrapped `LoadBalancer` decides) and never polls: a waiter
parks on a future that the balancer's listener resolves when a server is added or marked
healthy (every waiter retries) or a lease is released (the longest waiter retries, and passes
the turn on when it got a lease). Releases and membership changes may come from any thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from offbeat.balancer.balancer import LoadBalancer
from offbeat.balancer.lease import Lease, NoServerAvailable
from offbeat.balancer.policies import Policy

__all__ = ["AsyncLoadBalancer"]


class AsyncLoadBalancer:
    """`acquire(..., timeout=None)` waits until a server can take the request.

    Build it like a `LoadBalancer` (same arguments) or wrap an existing one with
    `AsyncLoadBalancer(balancer=lb)`; the wrapped balancer stays usable from threads.
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
        balancer: LoadBalancer | None = None,
    ) -> None:
        if balancer is None:
            balancer = LoadBalancer(
                servers,
                policy=policy,
                sticky_capacity=sticky_capacity,
                seed=seed,
                max_inflight=max_inflight,
                sticky_max_imbalance=sticky_max_imbalance,
            )
        elif servers is not None:
            raise TypeError("pass either servers (and options) or balancer=, not both")
        self.balancer = balancer
        self._waiters: dict[object, asyncio.Future[None]] = {}  # FIFO of parked acquires
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        balancer.add_listener(self._on_capacity)

    # ---- routing --------------------------------------------------------------------------
    async def acquire(
        self,
        request_id: Any,
        *,
        group_id: Any = None,
        prompt_ids: Sequence[int] | None = None,
        cost: int = 1,
        timeout: float | None = None,
    ) -> Lease:
        """A lease, waiting up to `timeout` seconds (None: forever) for a server to take it.

        Raises NoServerAvailable when the timeout passes (timeout=0: do not wait).
        """
        lb = self.balancer
        try:
            return lb.acquire(request_id, group_id=group_id, prompt_ids=prompt_ids, cost=cost)
        except NoServerAvailable:
            if timeout is not None and timeout <= 0:
                raise
        cap = lb._pool.max_inflight
        if cap is not None and cost > cap:
            raise ValueError(f"cost={cost} can never fit under max_inflight={cap}")
        loop = asyncio.get_running_loop()
        self._bind(loop)
        deadline = None if timeout is None else loop.time() + timeout
        turn = object()  # our place in the queue, kept across retries (FIFO)
        woken = False
        try:
            while True:
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters[turn] = fut  # parked before trying: no wake-up falls in between
                try:
                    lease = lb.acquire(
                        request_id, group_id=group_id, prompt_ids=prompt_ids, cost=cost
                    )
                except NoServerAvailable as e:
                    err = e
                else:
                    if woken:
                        del self._waiters[turn]
                        self._wake_one()  # there may be room left: the next waiter tries
                    return lease
                try:
                    if deadline is None:
                        await fut
                    else:
                        remaining = deadline - loop.time()
                        if remaining <= 0:
                            raise TimeoutError
                        async with asyncio.timeout(remaining):
                            await fut
                except BaseException as e:
                    del self._waiters[turn]
                    if fut.done() and not fut.cancelled():
                        self._wake_one()  # woken, but leaving without a lease: pass it on
                    if isinstance(e, TimeoutError):
                        raise NoServerAvailable(f"{err.detail}; waited {timeout}s") from None
                    raise
                woken = True
        finally:
            self._waiters.pop(turn, None)

    def release(self, lease: Lease) -> bool:
        """Same as `LoadBalancer.release` (also wakes the longest waiter)."""
        return self.balancer.release(lease)

    @asynccontextmanager
    async def lease(self, request_id: Any, **kwargs: Any) -> AsyncIterator[Lease]:
        """`async with alb.lease(rid) as lease:` acquires (waiting) and always releases."""
        lease = await self.acquire(request_id, **kwargs)
        try:
            yield lease
        finally:
            self.balancer.release(lease)

    # ---- the rest is the LoadBalancer's ------------------------------------------------------
    def add_servers(self, servers: Mapping[str, Any] | Iterable[str]) -> None:
        self.balancer.add_servers(servers)

    def remove_servers(self, ids: Iterable[str], *, drain: bool = False) -> set[str]:
        return self.balancer.remove_servers(ids, drain=drain)

    def mark_unhealthy(self, server_id: str) -> bool:
        return self.balancer.mark_unhealthy(server_id)

    def mark_healthy(self, server_id: str) -> bool:
        return self.balancer.mark_healthy(server_id)

    def inflight(self, server_id: str) -> int:
        return self.balancer.inflight(server_id)

    def servers(self) -> list[str]:
        return self.balancer.servers()

    def status(self) -> dict[str, Any]:
        return self.balancer.status()

    def clear_sticky(self) -> int:
        return self.balancer.clear_sticky()

    @property
    def waiting(self) -> int:
        """How many acquires are parked now."""
        return len(self._waiters)

    # ---- wake-ups -----------------------------------------------------------------------------
    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is self._loop:
            return
        if self._waiters:
            raise RuntimeError(
                "AsyncLoadBalancer is waited on from two event loops at once; "
                "use one AsyncLoadBalancer per loop (they can share one LoadBalancer)"
            )
        self._loop = loop
        self._loop_thread = threading.get_ident()

    def _on_capacity(self, kind: str) -> None:
        """Balancer listener; may run in any thread."""
        if not self._waiters:
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            self._wake(kind)
        else:
            loop.call_soon_threadsafe(self._wake, kind)

    def _wake(self, kind: str) -> None:
        if kind == "released":
            self._wake_one()
        else:  # new or recovered servers: everyone may fit now
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_result(None)

    def _wake_one(self) -> None:
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_result(None)
                return

    def __repr__(self) -> str:
        return f"AsyncLoadBalancer({self.balancer!r}, waiting={len(self._waiters)})"

"""Leases: the proof that a request was routed, and what releases it.

A lease knows nothing about policies or threads: it is a small record with `__slots__` made
on every acquire, so it stays cheap. Only the balancer that issued it may release it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offbeat.balancer.pool import Server

__all__ = ["Lease", "NoServerAvailable"]


class NoServerAvailable(RuntimeError):
    """No server accepts new requests (none registered, all draining, unhealthy or full)."""

    def __init__(self, detail: str = "") -> None:
        self.detail = detail or "no server accepts requests"
        super().__init__(f"No available servers: {self.detail}")

    def __reduce__(self):  # survive pickling (Ray ships exceptions) without doubling the text
        return (type(self), (self.detail,))


class Lease:
    """One routed request: `server_id`, `handle`, `request_id` and the `cost` it counts.

    Release it exactly once with `LoadBalancer.release(lease)` (a repeat is a no-op). A lease
    is bound to the server *incarnation* it was issued for: if that server is removed and
    added again, releasing the old lease leaves the new incarnation's count alone.
    """

    __slots__ = ("_open", "_server", "cost", "handle", "request_id", "server_id")

    server_id: str
    handle: Any
    request_id: Any
    cost: int

    def __init__(self, server: Server, request_id: Any, cost: int) -> None:
        self.server_id = server.id
        self.handle = server.handle
        self.request_id = request_id
        self.cost = cost
        self._server = server
        self._open = True

    @property
    def released(self) -> bool:
        """True once the lease was released (or its server was removed and it was released)."""
        return not self._open

    @property
    def incarnation(self) -> int:
        """The incarnation number of the server this lease counts against."""
        return self._server.incarnation

    def __reduce__(self):
        raise TypeError(
            "a Lease is bound to the LoadBalancer that issued it and cannot be pickled; "
            "across processes use the Ray wrapper (offbeat.balancer.actor), whose leases are "
            "plain RemoteLease records"
        )

    def __repr__(self) -> str:
        state = "released" if not self._open else "open"
        return (
            f"Lease(server_id={self.server_id!r}, request_id={self.request_id!r}, "
            f"cost={self.cost}, incarnation={self._server.incarnation}, {state})"
        )

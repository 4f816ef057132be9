"""A Ray actor over the LoadBalancer, for clients in other processes (extra `[ray]`).

Knows nothing about routing (the same `LoadBalancer` core decides) and imports Ray only inside
`make_balancer_actor`, so this module (and `BalancerActor`, a plain class) work without Ray.
Leases cross the process boundary as `RemoteLease` records; the actor keeps the real ones.
`acquire_many` routes a whole GRPO group in one call, which is what makes Ray fast enough.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from offbeat.balancer.balancer import LoadBalancer
from offbeat.balancer.lease import Lease, NoServerAvailable

__all__ = ["BalancerActor", "RemoteLease", "make_balancer_actor"]

_RAY_HINT = "the Ray wrapper needs Ray: pip install 'offbeat-balancer[ray]'"


class RemoteLease(NamedTuple):
    """What a client gets back: release it by passing it (or its `lease_id`) back."""

    lease_id: int
    server_id: str
    handle: Any
    request_id: Any


class BalancerActor:
    """The actor's body: a LoadBalancer whose leases are kept here and named by id.

    Takes the LoadBalancer's arguments. A plain class: test it, or run it in-process, as is.
    """

    def __init__(self, servers: Mapping[str, Any] | Iterable[str] | None = None, **kwargs: Any):
        self._lb = LoadBalancer(servers, **kwargs)
        self._open: dict[int, Lease] = {}
        self._ids = itertools.count(1)

    def acquire(
        self,
        request_id: Any,
        *,
        group_id: Any = None,
        prompt_ids: Sequence[int] | None = None,
        cost: int = 1,
    ) -> RemoteLease:
        lease = self._lb.acquire(request_id, group_id=group_id, prompt_ids=prompt_ids, cost=cost)
        lease_id = next(self._ids)
        self._open[lease_id] = lease
        return RemoteLease(lease_id, lease.server_id, lease.handle, request_id)

    def acquire_many(
        self,
        request_ids: Sequence[Any],
        *,
        group_id: Any = None,
        prompt_ids: Sequence[int] | None = None,
        cost: int = 1,
    ) -> list[RemoteLease]:
        """One lease per request id, all sharing `group_id` / `prompt_ids` (a GRPO group).

        All or nothing: if one cannot be routed, the ones already taken are released and
        NoServerAvailable is raised.
        """
        acquire = self._lb.acquire
        taken: list[Lease] = []
        try:
            for rid in request_ids:
                taken.append(acquire(rid, group_id=group_id, prompt_ids=prompt_ids, cost=cost))
        except NoServerAvailable:
            for lease in taken:
                self._lb.release(lease)
            raise
        out = []
        ids, open_ = self._ids, self._open
        for lease in taken:
            lease_id = next(ids)
            open_[lease_id] = lease
            out.append(RemoteLease(lease_id, lease.server_id, lease.handle, lease.request_id))
        return out

    def release(self, lease: RemoteLease | int) -> bool:
        """True the first time; False for a repeat, an unknown id or a removed server."""
        lease_id = lease if isinstance(lease, int) else lease.lease_id
        real = self._open.pop(lease_id, None)
        return real is not None and self._lb.release(real)

    def release_many(self, leases: Iterable[RemoteLease | int]) -> list[bool]:
        return [self.release(lease) for lease in leases]

    # ---- the rest is the LoadBalancer's ------------------------------------------------------
    def add_servers(self, servers: Mapping[str, Any] | Iterable[str]) -> None:
        self._lb.add_servers(servers)

    def remove_servers(self, ids: Iterable[str], *, drain: bool = False) -> set[str]:
        return self._lb.remove_servers(ids, drain=drain)

    def mark_unhealthy(self, server_id: str) -> bool:
        return self._lb.mark_unhealthy(server_id)

    def mark_healthy(self, server_id: str) -> bool:
        return self._lb.mark_healthy(server_id)

    def inflight(self, server_id: str) -> int:
        return self._lb.inflight(server_id)

    def servers(self) -> list[str]:
        return self._lb.servers()

    def status(self) -> dict[str, Any]:
        return {**self._lb.status(), "open_leases": len(self._open)}

    def clear_sticky(self) -> int:
        return self._lb.clear_sticky()


def make_balancer_actor(
    servers: Mapping[str, Any] | Iterable[str] | None = None,
    *,
    ray_options: Mapping[str, Any] | None = None,
    **balancer_kwargs: Any,
):
    """Start a `BalancerActor` as a Ray actor and return its handle.

    `ray_options` go to `ray.remote` / `.options` (default: `num_cpus=0`, since routing is
    cheap and should not take a CPU slot from the engines; add `name=` to share it by name).
    `balancer_kwargs` are the LoadBalancer's (policy, sticky_capacity, seed, max_inflight).
    Use: `ray.get(actor.acquire_many.remote(ids, group_id=g))`, then `release_many`.
    """
    try:
        import ray
    except ImportError as e:
        raise ImportError(_RAY_HINT) from e
    options = {"num_cpus": 0, **(ray_options or {})}
    return ray.remote(BalancerActor).options(**options).remote(servers, **balancer_kwargs)

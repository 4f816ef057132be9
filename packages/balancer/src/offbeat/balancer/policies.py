"""Routing policies and their registry.

A policy picks one server for one request from a `ServerPool`; it knows nothing about
leases, stickiness, draining or locks (the balancer handles those and calls `select` under its
lock, so a policy may keep unsynchronised state). Register your own with `register_policy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from offbeat.balancer.pool import Server, ServerPool

__all__ = [
    "LeastInflight",
    "Policy",
    "PowerOfTwo",
    "RoundRobin",
    "available_policies",
    "make_policy",
    "register_policy",
]


class Policy(ABC):
    """Chooses a server for a request. Return None when no server can take it."""

    name: str = ""

    @abstractmethod
    def select(
        self,
        pool: ServerPool,
        request_id: Any,
        group_id: Any,
        prompt_ids: Sequence[int] | None,
        cost: int,
    ) -> Server | None:
        """Pick an accepting server with room for `cost` (see `pool.has_room`)."""


_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register_policy(name: str, factory: Callable[..., Policy] | None = None):
    """Register `factory` (a Policy subclass or any callable returning a Policy) as `name`.

    Usable as a decorator: `@register_policy("mine") class Mine(Policy): ...`.
    Registering a taken name raises, so two plugins cannot silently shadow each other.
    """

    def _register(f: Callable[..., Policy]) -> Callable[..., Policy]:
        if name in _REGISTRY and _REGISTRY[name] is not f:
            raise ValueError(f"policy {name!r} is already registered ({_REGISTRY[name]!r})")
        _REGISTRY[name] = f
        return f

    return _register(factory) if factory is not None else _register


def available_policies() -> list[str]:
    """The registered policy names, sorted."""
    return sorted(_REGISTRY)


def make_policy(policy: str | Policy, **kwargs: Any) -> Policy:
    """A Policy from a registered name (with constructor `kwargs`) or an instance as is."""
    if isinstance(policy, Policy):
        if kwargs:
            raise TypeError("keyword arguments are only for a policy given by name")
        return policy
    try:
        factory = _REGISTRY[policy]
    except (KeyError, TypeError):
        raise ValueError(
            f"policy={policy!r} is not a registered policy; valid choices: "
            f"{', '.join(available_policies())} (or a Policy instance)"
        ) from None
    return factory(**kwargs)


@register_policy("least_inflight")
class LeastInflight(Policy):
    """The server with the lowest in-flight cost; ties rotate. O(log N) amortised."""

    name = "least_inflight"

    def select(self, pool, request_id, group_id, prompt_ids, cost):
        return pool.least_loaded(cost)


@register_policy("round_robin")
class RoundRobin(Policy):
    """Each accepting server in turn, skipping those without room."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, pool, request_id, group_id, prompt_ids, cost):
        active = pool.active
        n = len(active)
        for _ in range(n):
            srv = active[self._next % n]
            self._next = (self._next + 1) % n
            if pool.has_room(srv, cost):
                return srv
        return None


@register_policy("power_of_two")
class PowerOfTwo(Policy):
    """Two distinct servers drawn at random (the balancer's seeded rng); the less loaded wins."""

    name = "power_of_two"

    def select(self, pool, request_id, group_id, prompt_ids, cost):
        active = pool.active
        n = len(active)
        if n == 0:
            return None
        if n == 1:
            srv = active[0]
        else:
            rng = pool.rng
            i = rng.randrange(n)
            j = rng.randrange(n - 1)
            if j >= i:
                j += 1
            a, b = active[i], active[j]
            srv = a if a.inflight <= b.inflight else b
        if pool.has_room(srv, cost):
            return srv
        return pool.least_loaded(cost)  # both full: the least loaded may still have room

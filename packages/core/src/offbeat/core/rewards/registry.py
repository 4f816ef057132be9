"""Reward functions, looked up by the dataset's `data_source`.

Knows nothing about models or tokens: a reward function maps (response text, ground
truth, extra fields of the dataset row) to a float. Built-in scorers are registered here;
a user function is named by import path "pkg.mod:fn" (in config, per data_source). Any
exception a scorer raises becomes a `RewardError`, which the agent loop turns into a
failed group instead of a crash.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

RewardFn = Callable[..., float]  # fn(response: str, ground_truth: str, **extra) -> float

_REGISTRY: dict[str, RewardFn] = {}


class RewardError(RuntimeError):
    """A reward function failed (or none is registered) for one response."""


def register_reward(data_source: str, fn: RewardFn | None = None):
    """Register `fn` for `data_source`; usable as a decorator."""

    def deco(f: RewardFn) -> RewardFn:
        _REGISTRY[data_source] = f
        return f

    return deco(fn) if fn is not None else deco


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def load_reward_fn(path: str) -> RewardFn:
    """Import a user reward function from "pkg.mod:fn"."""
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"reward function path {path!r}: expected 'pkg.module:function'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"reward function path {path!r}: cannot import {mod_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function path {path!r}: {mod_name} has no callable {attr!r}")
    return fn


class RewardRegistry:
    """Resolves a data_source to a reward function: config overrides (import paths) first,
    then the registered scorers. Resolution is cached; import errors surface at build."""

    def __init__(self, overrides: Mapping[str, str] | None = None) -> None:
        self._fns: dict[str, RewardFn] = {}
        for source, path in (overrides or {}).items():
            self._fns[source] = load_reward_fn(path)

    def get(self, data_source: str) -> RewardFn:
        fn = self._fns.get(data_source) or _REGISTRY.get(data_source)
        if fn is None:
            raise RewardError(
                f"no reward function for data_source={data_source!r}; registered: "
                f"{sorted(set(_REGISTRY) | set(self._fns))} (or map it to 'pkg.mod:fn' "
                "in rewards.functions)"
            )
        return fn

    def score(
        self, data_source: str, response: str, ground_truth: Any, extra: Mapping[str, Any] = {}
    ) -> float:
        fn = self.get(data_source)
        try:
            value = fn(response, ground_truth, **extra)
            value = float(value)
        except Exception as e:  # any scorer bug must become a failed group, never a crash
            raise RewardError(f"reward {data_source!r} raised {type(e).__name__}: {e}") from e
        if value != value:  # NaN
            raise RewardError(f"reward {data_source!r} returned NaN")
        return value

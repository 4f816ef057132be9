"""Reward functions, looked up by the dataset's `data_source`.

Knows nothing about models or tokens: a reward function maps (response text, ground
truth, extra fields of the dataset row) to a float. Scorers live in core's
`REWARD_FUNCTIONS` registry under the data_source they score; the config's `reward.name`
is either "task" (score each row with its own data_source's function) or one registered
name used for every row. A user function is named by import path "pkg.mod:fn", per
data_source. Any exception a scorer raises becomes a `RewardError`, which the agent loop
turns into a failed group instead of a crash.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from offbeat.core.registry import REWARD_FUNCTIONS

RewardFn = Callable[..., float]  # fn(response: str, ground_truth: str, **extra) -> float

# `reward.name` value that means: dispatch on each row's data_source.
BY_DATA_SOURCE = "task"


class RewardError(RuntimeError):
    """A reward function failed (or none is registered) for one response."""


def register_reward(data_source: str, fn: RewardFn | None = None):
    """Register `fn` for `data_source`; usable as a decorator."""

    def deco(f: RewardFn) -> RewardFn:
        REWARD_FUNCTIONS.register(data_source, f, override=True)
        return f

    return deco(fn) if fn is not None else deco


def registered_rewards() -> list[str]:
    return REWARD_FUNCTIONS.names()


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
    """Resolves a data_source to a reward function: `functions` (data_source ->
    "pkg.mod:fn", imported now so a bad path fails before anything starts) first, then the
    registered scorers. With `name` other than "task", that one scorer scores every row.
    `kwargs` are passed to every call."""

    def __init__(
        self,
        functions: Mapping[str, str] | None = None,
        *,
        name: str = BY_DATA_SOURCE,
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._fns: dict[str, RewardFn] = {}
        for source, path in (functions or {}).items():
            self._fns[source] = load_reward_fn(path)
        self.name = name
        self.kwargs = dict(kwargs or {})
        if name != BY_DATA_SOURCE:
            self._fixed: RewardFn | None = REWARD_FUNCTIONS.get(name)
        else:
            self._fixed = None

    def get(self, data_source: str) -> RewardFn:
        if self._fixed is not None:
            return self._fixed
        fn = self._fns.get(data_source)
        if fn is None and data_source != BY_DATA_SOURCE and data_source in REWARD_FUNCTIONS:
            fn = REWARD_FUNCTIONS.get(data_source)
        if fn is None:
            known = sorted((set(REWARD_FUNCTIONS.names()) | set(self._fns)) - {BY_DATA_SOURCE})
            raise RewardError(
                f"no reward function for data_source={data_source!r}; registered: {known} "
                "(or map it to a user function 'pkg.mod:fn')"
            )
        return fn

    def score(
        self, data_source: str, response: str, ground_truth: Any, extra: Mapping[str, Any] = {}
    ) -> float:
        fn = self.get(data_source)
        try:
            value = fn(response, ground_truth, **{**self.kwargs, **extra})
            value = float(value)
        except Exception as e:  # any scorer bug must become a failed group, never a crash
            raise RewardError(f"reward {data_source!r} raised {type(e).__name__}: {e}") from e
        if value != value:  # NaN
            raise RewardError(f"reward {data_source!r} returned NaN")
        return value

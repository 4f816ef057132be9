"""Reward functions, looked up by the dataset's `data_source`.

Knows nothing about models or tokens: a reward function maps (response text, ground
truth, the row's data_source and extra_info) to a float. Scorers live in core's
`REWARD_FUNCTIONS` registry under the data_source they score; the config's `reward.name`
is either "task" (score each row with its own data_source's function) or one registered
name used for every row. A user function is named per data_source (`reward.functions`)
by "pkg.mod:fn" or "path/to/file.py:fn". Any exception a scorer raises becomes a
`RewardError`, which the agent loop turns into a failed group instead of a crash.

How a function is called (`RewardRegistry.score`), in either of two signatures:

* offbeat's: `fn(response, ground_truth, **kw)`. `kw` holds `reward.kwargs` plus
  `data_source=` (str) and `extra_info=` (dict, the row's `extra_info`, `{}` if none);
  those two are passed only when `fn` takes them (by name, or through `**kwargs`).
* verl's: a function whose first parameter is named `data_source`, e.g.
  `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, is called
  with keywords `data_source=, solution_str=, ground_truth=, extra_info=` (+ reward.kwargs).

A function returns a number, or (as verl's may) a dict holding it under "score".
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from offbeat.core.registry import REWARD_FUNCTIONS

RewardFn = Callable[..., float]  # fn(response: str, ground_truth: str, **kw) -> float

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


def _import_file(file: str) -> Any:
    path = Path(file).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no such file {str(path)!r}")
    name = f"offbeat_reward_{path.stem}_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_reward_fn(path: str) -> RewardFn:
    """Import a user reward function from "pkg.mod:fn" or "path/to/file.py:fn"."""
    mod_name, sep, attr = str(path).rpartition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(
            f"reward function path {path!r}: expected 'pkg.module:function' or "
            "'path/to/file.py:function'"
        )
    try:
        if mod_name.endswith(".py"):
            module = _import_file(mod_name)
        else:
            module = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or whatever the module raised while importing
        raise ValueError(
            f"reward function path {path!r}: cannot import {mod_name!r}: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function path {path!r}: {mod_name} has no callable {attr!r}")
    return fn


_ROW_FIELDS = ("data_source", "extra_info")


def _convention(fn: RewardFn) -> tuple[bool, frozenset[str] | None]:
    """(verl-style?, the row fields `fn` accepts; None: all of them, through **kwargs)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: pass the fields
        return False, None
    verl = bool(params) and params[0].name == "data_source"
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return verl, None
    named = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return verl, frozenset(named & set(_ROW_FIELDS))


_cached_convention = functools.cache(_convention)


def call_reward_fn(
    fn: RewardFn,
    response: str,
    ground_truth: Any,
    *,
    data_source: str = "",
    extra_info: Mapping[str, Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """Call `fn` in its own signature (see the module docstring); return what it returns."""
    try:
        verl, accepts = _cached_convention(fn)
    except TypeError:  # an unhashable callable
        verl, accepts = _convention(fn)
    row = {"data_source": data_source, "extra_info": dict(extra_info or {})}
    fields = row if accepts is None else {k: v for k, v in row.items() if k in accepts}
    kw = {**(kwargs or {}), **fields}
    if verl:
        return fn(solution_str=response, ground_truth=ground_truth, **kw)
    return fn(response, ground_truth, **kw)


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
                "(or map it to a user function: reward.functions.<data_source>='pkg.mod:fn')"
            )
        return fn

    def score(
        self,
        data_source: str,
        response: str,
        ground_truth: Any,
        extra_info: Mapping[str, Any] | None = None,
    ) -> float:
        """The reward of `response` for a row of `data_source`; raises `RewardError`."""
        fn = self.get(data_source)
        try:
            value = call_reward_fn(
                fn, response, ground_truth, data_source=data_source, extra_info=extra_info,
                kwargs=self.kwargs,
            )  # fmt: skip
            if isinstance(value, Mapping):  # verl's scorers may return {"score": ..., ...}
                value = value["score"]
            value = float(value)
        except Exception as e:  # any scorer bug must become a failed group, never a crash
            raise RewardError(f"reward {data_source!r} raised {type(e).__name__}: {e}") from e
        if value != value:  # NaN
            raise RewardError(f"reward {data_source!r} returned NaN")
        return value

    def score_group(
        self,
        data_source: str,
        responses: list[str],
        ground_truth: Any,
        extra_info: Mapping[str, Any] | None = None,
    ) -> list[float]:
        """The rewards of one prompt's responses: in one call where the scorer has a
        `score_group(responses, ground_truth, **kw) -> list` attribute (e.g. `genrm`,
        which judges them concurrently), else one `score` each; raises `RewardError`."""
        fn = self.get(data_source)
        group = getattr(fn, "score_group", None)
        if group is None:
            return [self.score(data_source, r, ground_truth, extra_info) for r in responses]
        try:
            values = call_reward_fn(
                group, list(responses), ground_truth, data_source=data_source,
                extra_info=extra_info, kwargs=self.kwargs,
            )  # fmt: skip
            values = [float(v) for v in values]
        except Exception as e:  # any scorer bug must become a failed group, never a crash
            raise RewardError(f"reward {data_source!r} raised {type(e).__name__}: {e}") from e
        if len(values) != len(responses) or any(v != v for v in values):
            raise RewardError(
                f"reward {data_source!r} returned {len(values)} values (NaN?) for "
                f"{len(responses)} responses"
            )
        return values

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

A function returns a number, or (as verl's may) a dict holding it under "score". None, a
string, NaN or an infinity is not a reward: the response's group fails (reason
`reward_invalid`), it is never trained on as 0.

Sync or async, each call has a deadline, `reward.timeout_s` (`DEFAULT_TIMEOUT_S`, 30 s):
`RewardRegistry.ascore_group` (what the agent loops await) runs a sync function in a
thread of its own, never on the event loop, and an async one under `asyncio.wait_for`. A
call past its deadline fails its group (reason `reward_timeout`); a sync one cannot be
killed, so its thread is abandoned (`offbeat.core.user_code`) and the run moves on. A
scorer with a true `own_timeout` attribute bounds its own time (the GenRM judge:
`reward.genrm.timeout_s` per request) and is not cut.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offbeat.core.registry import REWARD_FUNCTIONS
from offbeat.core.user_code import UserCodeTimeout, call_user_code

if TYPE_CHECKING:
    from offbeat.core.config.schema import RewardConfig

RewardFn = Callable[..., float]  # fn(response: str, ground_truth: str, **kw) -> float

# `reward.name` value that means: dispatch on each row's data_source.
BY_DATA_SOURCE = "task"
DEFAULT_TIMEOUT_S = 30.0  # reward.timeout_s: the deadline of one reward call
DEFAULT_THREADS = 4  # sync reward calls running at once, per registry

# Why a reward call failed: the `failed/<reason>_total` metric a failed group counts in.
REWARD_REASONS = ("reward_error", "reward_invalid", "reward_timeout", "reward_missing")


class RewardError(RuntimeError):
    """A reward function failed (or none is registered) for one response. `reason`: one
    of `REWARD_REASONS`."""

    def __init__(self, message: str, reason: str = "reward_error") -> None:
        super().__init__(message)
        self.reason = reason


def as_reward(data_source: str, value: Any) -> float:
    """`value` as a reward (a finite number, or a dict with one under "score"); raises
    `RewardError` (reason `reward_invalid`) naming what came back instead."""
    if isinstance(value, Mapping):  # verl's scorers may return {"score": ..., ...}
        if "score" not in value:
            raise RewardError(
                f"reward {data_source!r} returned a dict without 'score' (keys "
                f"{sorted(map(str, value))[:8]})",
                "reward_invalid",
            )
        value = value["score"]
    if value is None or isinstance(value, str | bytes):
        raise RewardError(
            f"reward {data_source!r} returned {value!r:.80} ({type(value).__name__}), not a number",
            "reward_invalid",
        )
    try:
        number = float(value)
    except (TypeError, ValueError) as e:
        raise RewardError(
            f"reward {data_source!r} returned a {type(value).__name__}, not a number ({e})",
            "reward_invalid",
        ) from e
    if not math.isfinite(number):
        raise RewardError(
            f"reward {data_source!r} returned {'NaN' if math.isnan(number) else number} (a "
            "reward must be a finite number)",
            "reward_invalid",
        )
    return number


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
    `kwargs` are passed to every call. `timeout_s`: the deadline of each call awaited
    through `ascore_group` (None: none); `threads`: sync calls running at once there."""

    def __init__(
        self,
        functions: Mapping[str, str] | None = None,
        *,
        name: str = BY_DATA_SOURCE,
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        threads: int = DEFAULT_THREADS,
    ) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"reward timeout_s={timeout_s!r}: must be > 0 (or None)")
        if threads < 1:
            raise ValueError(f"reward threads={threads!r}: must be >= 1")
        self.timeout_s = timeout_s
        self.threads = threads
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
                "(or map it to a user function: reward.functions.<data_source>='pkg.mod:fn')",
                "reward_missing",
            )
        return fn

    @property
    def needs_ground_truth(self) -> bool:
        """False when one scorer scores every row and takes the ground truth only as an
        optional reference (a true `ground_truth_optional` attribute: the GenRM judge)."""
        return not getattr(self._fixed, "ground_truth_optional", False)

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
        except Exception as e:  # any scorer bug must become a failed group, never a crash
            raise RewardError(f"reward {data_source!r} raised {type(e).__name__}: {e}") from e
        return as_reward(data_source, value)

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
            values = list(values)
        except Exception as e:  # any scorer bug must become a failed group, never a crash
            raise RewardError(f"reward {data_source!r} raised {type(e).__name__}: {e}") from e
        return _group_values(data_source, values, len(responses))

    async def ascore_group(
        self,
        data_source: str,
        responses: list[str],
        ground_truth: Any,
        extra_info: Mapping[str, Any] | None = None,
    ) -> list[float]:
        """`score_group` for the event loop: each call off the loop (a sync function in a
        thread of its own, at most `threads` at once) and under `timeout_s`; the
        responses of a group are scored concurrently. Raises `RewardError`."""
        fn = self.get(data_source)
        group = getattr(fn, "score_group", None)
        if group is not None:
            values = await self._acall(fn, group, data_source, list(responses), ground_truth,
                                       extra_info)  # fmt: skip
            try:
                values = list(values)
            except TypeError as e:
                raise RewardError(
                    f"reward {data_source!r} returned a {type(values).__name__}, not a list",
                    "reward_invalid",
                ) from e
            return _group_values(data_source, values, len(responses))
        results = await asyncio.gather(
            *(self._acall(fn, fn, data_source, r, ground_truth, extra_info) for r in responses),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [as_reward(data_source, v) for v in results]

    async def _acall(
        self, fn: RewardFn, target: Callable[..., Any], data_source: str, first: Any,
        ground_truth: Any, extra_info: Mapping[str, Any] | None,
    ) -> Any:  # fmt: skip
        """`target` (fn, or its score_group) called in its own signature, within the
        deadline; what it returns, unchecked."""
        call = functools.partial(
            call_reward_fn, target, first, ground_truth, data_source=data_source,
            extra_info=extra_info, kwargs=self.kwargs,
        )  # fmt: skip
        timeout = None if getattr(fn, "own_timeout", False) else self.timeout_s
        is_async = inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
            getattr(target, "__call__", None)  # noqa: B004
        )
        try:
            if is_async:

                async def run() -> Any:
                    return await call()

                return await call_user_code(run, timeout_s=timeout)
            return await call_user_code(call, timeout_s=timeout, limit=(id(self), self.threads))
        except UserCodeTimeout as e:
            raise RewardError(
                f"reward {data_source!r} ran past reward.timeout_s={timeout:g} s (the call "
                "is abandoned: a sync function's thread runs on until it returns, unwaited)",
                "reward_timeout",
            ) from e
        except Exception as e:  # any scorer bug must become a failed group, never a crash
            raise RewardError(f"reward {data_source!r} raised {type(e).__name__}: {e}") from e


def _group_values(data_source: str, values: list[Any], n: int) -> list[float]:
    if len(values) != n:
        raise RewardError(
            f"reward {data_source!r} returned {len(values)} values for {n} responses",
            "reward_invalid",
        )
    return [as_reward(data_source, v) for v in values]


def reward_registry(r: RewardConfig) -> RewardRegistry:
    """A job's `RewardRegistry` from its `reward` section: `reward.functions` (user
    functions by data_source) first, then the registered scorers; `reward.name` other than
    "task" scores every row."""
    return RewardRegistry(r.functions, name=r.name, kwargs=r.kwargs, timeout_s=r.timeout_s)

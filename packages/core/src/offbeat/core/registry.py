"""Small name → object registries, and the ones offbeat's config names point into.

A registry knows nothing about what it holds: advantage estimators, loss-aggregation
modes, rollout engines, train engines, reward functions, rewards' job extensions and
devices all use the same class. Names are filled three ways, all resolved lazily on the
first lookup:

* `REG.register("name", obj)` (or `@REG.register("name")`) from the providing module;
* `builtin_modules`: modules of this distribution imported on first lookup, so that a
  lookup sees core's own providers without the caller importing them first;
* `entry_point_group`: installed plugins. Each entry point names a zero-argument
  *register hook* (e.g. ``npu = offbeat.device_ascend:register``) that is called the first
  time its name is looked up and must register that name. Plugin names are listed by
  `names()` without importing the plugin, so a config error can list them cheaply.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")

__all__ = [
    "ADV_ESTIMATORS",
    "DEVICES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "REWARD_EXTENSIONS",
    "REWARD_FUNCTIONS",
    "ROLLOUT_ENGINES",
    "TRAIN_ENGINES",
    "Registry",
    "UnknownNameError",
]


class UnknownNameError(KeyError):
    """A name that no provider registered. The message lists the registered names."""

    def __init__(self, kind: str, name: object, known: list[str]) -> None:
        self.kind, self.name, self.known = kind, name, known
        choices = ", ".join(known) if known else "(none registered)"
        super().__init__(f"unknown {kind} {name!r}; registered: {choices}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class Registry(Generic[T]):
    """Maps names to objects of one kind (`kind` is used in error messages)."""

    def __init__(
        self,
        kind: str,
        *,
        entry_point_group: str | None = None,
        builtin_modules: tuple[str, ...] = (),
    ) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self._builtin_modules = builtin_modules
        self._builtins_loaded = False
        self._items: dict[str, T] = {}

    # -- filling -------------------------------------------------------------------------

    @overload
    def register(
        self, name: str, obj: None = None, *, override: bool = False
    ) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, obj: T, *, override: bool = False) -> T: ...

    def register(self, name: str, obj: T | None = None, *, override: bool = False) -> Any:
        """Register `obj` under `name`; without `obj`, return a decorator that does.

        Registering a name twice is an error unless `override=True` (re-registering the
        very same object is allowed, so re-imports are harmless).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} registry: name must be a non-empty string, got {name!r}")

        def _add(o: T) -> T:
            old = self._items.get(name)
            if old is not None and old is not o and not override:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered ({old!r}); "
                    "pass override=True to replace it"
                )
            self._items[name] = o
            return o

        return _add if obj is None else _add(obj)

    def unregister(self, name: str) -> None:
        """Remove `name` (missing names are ignored). Mostly for tests."""
        self._items.pop(name, None)

    # -- lookup --------------------------------------------------------------------------

    def get(self, name: str) -> T:
        """The object registered under `name`, loading a plugin if one provides it."""
        self._load_builtins()
        if name in self._items:
            return self._items[name]
        ep = self._entry_points().get(name)
        if ep is not None:
            hook = ep.load()
            hook()  # a register hook: it registers `name` (and may raise a clear error)
            if name in self._items:
                return self._items[name]
            raise RuntimeError(
                f"entry point {ep.value!r} in group {self.entry_point_group!r} "
                f"did not register {self.kind} {name!r}"
            )
        raise UnknownNameError(self.kind, name, self.names())

    def names(self) -> list[str]:
        """Every known name, sorted: registered ones and installed plugins' names."""
        self._load_builtins()
        return sorted(set(self._items) | set(self._entry_points()))

    def registered(self) -> dict[str, T]:
        """The names registered so far (plugins not yet loaded are left out)."""
        self._load_builtins()
        return dict(self._items)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        self._load_builtins()
        # Registered names first: scanning installed distributions for entry points costs
        # milliseconds, and `in` runs on hot paths (a reward lookup per sample).
        return name in self._items or name in self._entry_points()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"

    # -- internals -----------------------------------------------------------------------

    def _load_builtins(self) -> None:
        if self._builtins_loaded:
            return
        self._builtins_loaded = True
        for module in self._builtin_modules:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as e:
                # The providing subpackage is not part of this install: nothing to add.
                # Any other missing module is a real error inside the provider.
                if e.name is None or not module.startswith(e.name):
                    raise

    def _entry_points(self) -> dict[str, EntryPoint]:
        if self.entry_point_group is None:
            return {}
        return {ep.name: ep for ep in entry_points(group=self.entry_point_group)}


# The registries that the job config names point into. Core's own providers register on
# import of the builtin modules; other distributions register through entry points.
ADV_ESTIMATORS: Registry[Callable[..., Any]] = Registry(
    "advantage estimator",
    entry_point_group="offbeat.adv_estimators",
    builtin_modules=("offbeat.core.algorithms",),
)
LOSS_AGG_MODES: Registry[Callable[..., Any]] = Registry(
    "loss aggregation mode", builtin_modules=("offbeat.core.algorithms",)
)
KL_ESTIMATORS: Registry[Callable[..., Any]] = Registry(
    "KL estimator", builtin_modules=("offbeat.core.algorithms",)
)
ROLLOUT_ENGINES: Registry[Any] = Registry(
    "rollout engine", entry_point_group="offbeat.rollout_engines"
)
TRAIN_ENGINES: Registry[Any] = Registry(
    "train engine",
    entry_point_group="offbeat.train_engines",
    builtin_modules=("offbeat.core.train",),
)
REWARD_FUNCTIONS: Registry[Any] = Registry(
    "reward function",
    entry_point_group="offbeat.rewards",
    builtin_modules=("offbeat.core.rewards",),
)
# A reward's part of the job (`offbeat.core.trainer.extension`): reward.name -> a
# zero-argument factory of the `JobExtension` that reward needs (GenRM: its judge replicas).
REWARD_EXTENSIONS: Registry[Callable[[], Any]] = Registry(
    "reward job extension",
    entry_point_group="offbeat.reward_extensions",
    builtin_modules=("offbeat.core.rewards.genrm_extension",),
)
DEVICES: Registry[Any] = Registry(
    "device", entry_point_group="offbeat.devices", builtin_modules=("offbeat.core.device",)
)

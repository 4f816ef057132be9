"""The backend registry and the two interfaces every backend implements.

A backend moves buckets from one sender to N receivers. The sender side (`Sender`) lives in
the trainer process and is driven by the manager; the receiver side is a classmethod run
where the model lives, from nothing but a picklable `ReceiveSpec`. Knows nothing about the
lifecycle around a transfer (that is the manager's job) nor about any inference engine.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from offbeat.ckpt_engine.target import LoadWeightsFn, ReceiveSpec

__all__ = ["Backend", "SendReport", "Sender", "backends", "get_backend", "register_backend"]

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass
class SendReport:
    """What the sender saw: bytes and buckets streamed, and receivers that failed (by rank)."""

    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    failed: dict[int, str] = field(default_factory=dict)


class Sender(ABC):
    """The sending end of one sync. `send` blocks; `drop` and `abort` may be called from
    another thread to stop waiting for one receiver or for all of them."""

    @abstractmethod
    def spec(self, rank: int) -> ReceiveSpec:
        """The picklable spec receiver `rank` (0..num_receivers-1) runs `receive` with."""

    @abstractmethod
    def send(self, named_tensors: NamedTensors) -> SendReport: ...

    def drop(self, rank: int, reason: str) -> None:  # noqa: B027 - optional hook
        """Stop waiting for receiver `rank` (its caller saw it fail)."""

    @abstractmethod
    def abort(self, reason: str) -> None: ...


class Backend(ABC):
    """A registered way to move buckets. Instances hold state reused across syncs (for
    example process groups); the receiving side needs no instance."""

    name: ClassVar[str]
    # Used when the manager is given no bucket size; see the README's "Bucket size".
    default_bucket_bytes: ClassVar[int] = 256 << 20
    # Where receivers may live relative to the sender: "process" (the same process),
    # "host" (the same machine) or "cluster" (other machines too, given options that make
    # the sender reachable). A job that places replicas elsewhere checks this first.
    reach: ClassVar[str] = "cluster"
    # torch device types the sender's buffers need; empty: any.
    device_types: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **options: Any) -> None:
        if options:
            raise ValueError(f"backend {self.name!r} takes no options, got {sorted(options)}")

    @abstractmethod
    def open_sender(
        self,
        *,
        version: int,
        num_receivers: int,
        bucket_bytes: int,
        checksum: bool,
        timeout_s: float,
        members: tuple[str, ...] = (),
    ) -> Sender:
        """Prepare one sync to `num_receivers` receivers. `members` names them in rank
        order; backends that build process groups reuse them while it is unchanged.
        A backend whose sender lives in another process (a trainer rank, where the
        weights are) may return an awaitable of the Sender: the manager awaits it."""

    @classmethod
    @abstractmethod
    def receive(
        cls, spec: ReceiveSpec, load_weights: LoadWeightsFn, current_version: int | None
    ) -> int:
        """Receive every bucket of `spec` into `load_weights`; return `spec.version`."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release anything kept across syncs."""


_REGISTRY: dict[str, type[Backend]] = {}
_FAILED: dict[str, str] = {}
_BUILTIN = {
    "naive": "offbeat.ckpt_engine.naive",
    "shm": "offbeat.ckpt_engine.shm",
    "cuda_ipc": "offbeat.ckpt_engine.cuda_ipc",
    "broadcast": "offbeat.ckpt_engine.broadcast",
    "disk": "offbeat.ckpt_engine.disk",
}
_loaded = False


def register_backend(name: str, cls: type[Backend]) -> type[Backend]:
    """Register `cls` under `name` (a later registration of the same name replaces it)."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"backend {name!r} must be a Backend subclass, got {cls!r}")
    cls.name = name
    _REGISTRY[name] = cls
    _FAILED.pop(name, None)
    return cls


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name, module in _BUILTIN.items():
        if name in _REGISTRY:
            continue
        try:
            importlib.import_module(module)  # registers itself
        except Exception as e:  # an optional dependency may be missing
            _FAILED[name] = f"{type(e).__name__}: {e}"
            continue
        if name not in _REGISTRY:
            _FAILED[name] = f"module {module} imported but registered no backend {name!r}"


def backends() -> list[str]:
    """Names of the registered backends that imported."""
    _load_builtins()
    return sorted(_REGISTRY)


def get_backend(name: str) -> type[Backend]:
    """The backend class registered as `name`; a ValueError names the valid ones otherwise."""
    _load_builtins()
    cls = _REGISTRY.get(name)
    if cls is not None:
        return cls
    msg = f"unknown checkpoint-engine backend {name!r}; registered: {', '.join(sorted(_REGISTRY)) or 'none'}"
    if _FAILED:
        msg += "; failed to import: " + "; ".join(
            f"{n} ({err})" for n, err in sorted(_FAILED.items())
        )
    raise ValueError(msg)

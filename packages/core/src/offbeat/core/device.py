"""The accelerator shim: only what offbeat's code asks of a device type.

A `Device` names its torch device type, its collective backend, the environment
variable that limits which devices a process sees, and offers synchronize and memory
statistics. cpu and cuda are built in; other accelerators register from their own
distribution through the `offbeat.devices` entry-point group (see offbeat-device-ascend),
importing their vendor library only there. Knows nothing about models or parallelism.
"""

from __future__ import annotations

import os
import resource
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from offbeat.core.registry import DEVICES

__all__ = [
    "CpuDevice",
    "CudaDevice",
    "Device",
    "MemoryStats",
    "current_device",
    "get_device",
    "register_device",
]


@dataclass(frozen=True)
class MemoryStats:
    current_bytes: int  # now: allocated by torch (accelerators) or resident set (CPU)
    peak_bytes: int  # high-water mark of the same quantity


class Device(ABC):
    """One kind of accelerator. Subclasses set the class attributes and the methods."""

    name: str  # the registry / config name ("cpu", "cuda", "npu")
    torch_type: str  # torch.device type
    backend: str  # torch.distributed backend
    visible_devices_env: str | None  # e.g. CUDA_VISIBLE_DEVICES; None: not applicable

    @abstractmethod
    def is_available(self) -> bool: ...

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def memory_stats(self) -> MemoryStats: ...

    def torch_device(self, index: int | None = None) -> torch.device:
        return torch.device(self.torch_type, index)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, backend={self.backend!r})"


class CpuDevice(Device):
    name, torch_type, backend, visible_devices_env = "cpu", "cpu", "gloo", None

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def synchronize(self) -> None:
        return None  # CPU ops are synchronous

    def memory_stats(self) -> MemoryStats:
        current = _current_rss()
        # ru_maxrss is updated lazily by the kernel and can trail the live RSS.
        return MemoryStats(current, max(current, _peak_rss()))


class CudaDevice(Device):
    name, torch_type, backend = "cuda", "cuda", "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())


def register_device(device: Device, *, override: bool = False) -> Device:
    """Make `device` available under `device.name` (what plugins' register hooks call)."""
    return DEVICES.register(device.name, device, override=override)


def get_device(name: str) -> Device:
    """The device registered as `name` (a plugin is loaded on first use)."""
    return DEVICES.get(name)


def current_device() -> Device:
    """cuda when a CUDA device is usable, else cpu."""
    return get_device("cuda" if torch.cuda.is_available() else "cpu")


def _current_rss() -> int:
    try:  # Linux: resident pages, second field of statm
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss()  # no procfs: the peak is the best bound we have


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


register_device(CpuDevice())
register_device(CudaDevice())

"""The Ascend NPU as an offbeat `Device`: torch type "npu", collective backend HCCL.

Uses `torch.npu`, which exists only after `torch_npu` has been imported; `register()`
in this package's `__init__` does that import. Knows nothing else about Ascend.
"""

from __future__ import annotations

import torch

from offbeat.core.device import Device, MemoryStats

__all__ = ["NpuDevice"]


class NpuDevice(Device):
    name, torch_type, backend = "npu", "npu", "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"

    def is_available(self) -> bool:
        return bool(torch.npu.is_available())

    def device_count(self) -> int:
        return int(torch.npu.device_count())

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(int(torch.npu.memory_allocated()), int(torch.npu.max_memory_allocated()))

"""Device registry: built-in cpu/cuda, current_device, memory stats, plugins."""

from __future__ import annotations

import pytest
import torch

from offbeat.core.device import (
    CpuDevice,
    Device,
    MemoryStats,
    current_device,
    get_device,
    register_device,
)
from offbeat.core.registry import DEVICES


def test_builtin_devices():
    cpu, cuda = get_device("cpu"), get_device("cuda")
    assert (cpu.torch_type, cpu.backend, cpu.visible_devices_env) == ("cpu", "gloo", None)
    assert (cuda.torch_type, cuda.backend) == ("cuda", "nccl")
    assert cuda.visible_devices_env == "CUDA_VISIBLE_DEVICES"
    assert cpu.is_available() and cpu.device_count() == 1
    assert cpu.torch_device() == torch.device("cpu")
    assert {"cpu", "cuda"} <= set(DEVICES.names())


def test_current_device_follows_cuda_availability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert current_device().name == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert current_device().name == "cuda"


def test_cpu_memory_stats_track_rss():
    cpu = get_device("cpu")
    cpu.synchronize()
    before = cpu.memory_stats()
    assert isinstance(before, MemoryStats) and 0 < before.current_bytes <= before.peak_bytes
    block = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)  # 64 MiB, touched
    after = cpu.memory_stats()
    assert after.peak_bytes >= before.current_bytes + 48 * 1024 * 1024
    del block


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_stats():
    cuda = get_device("cuda")
    x = torch.ones(1024, 1024, device="cuda")
    cuda.synchronize()
    stats = cuda.memory_stats()
    assert stats.current_bytes >= x.numel() * 4 and stats.peak_bytes >= stats.current_bytes


def test_plugin_device_registers_and_unknown_lists_names():
    class FakeDevice(CpuDevice):
        name, torch_type, backend = "fake", "cpu", "gloo"

    try:
        assert register_device(FakeDevice()).name == "fake"
        assert isinstance(get_device("fake"), Device)
        with pytest.raises(ValueError, match="already registered"):
            register_device(FakeDevice())
    finally:
        DEVICES.unregister("fake")
    with pytest.raises(KeyError, match=r"unknown device 'tpu'; registered: .*cpu"):
        get_device("tpu")

"""The npu device plugin: entry point, the missing-torch_npu error, registration."""

from __future__ import annotations

import sys
import types
from importlib.metadata import entry_points

import pytest
import torch

import offbeat.device_ascend as ascend
from offbeat.core.device import get_device
from offbeat.core.registry import DEVICES


def test_entry_point_resolves_to_register():
    (ep,) = [ep for ep in entry_points(group="offbeat.devices") if ep.name == "npu"]
    assert ep.load() is ascend.register
    assert "npu" in DEVICES.names()  # listed without importing torch_npu


@pytest.mark.skipif("torch_npu" in sys.modules, reason="torch_npu is installed here")
def test_without_torch_npu_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails even if installed
    with pytest.raises(ImportError) as ei:
        ascend.register()
    assert str(ei.value) == "the npu device needs torch_npu: install offbeat-device-ascend[npu]"
    with pytest.raises(ImportError, match=r"install offbeat-device-ascend\[npu\]"):
        get_device("npu")


def test_with_torch_npu_the_device_registers(monkeypatch):
    calls = []
    fake_npu = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 8,
        synchronize=lambda: calls.append("sync"),
        memory_allocated=lambda: 10,
        max_memory_allocated=lambda: 20,
    )
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    DEVICES.unregister("npu")
    try:
        dev = get_device("npu")  # through the entry point hook
        assert isinstance(dev, ascend.NpuDevice)
        assert (dev.backend, dev.visible_devices_env) == ("hccl", "ASCEND_RT_VISIBLE_DEVICES")
        assert dev.is_available() and dev.device_count() == 8
        dev.synchronize()
        assert calls == ["sync"]
        assert (dev.memory_stats().current_bytes, dev.memory_stats().peak_bytes) == (10, 20)
        ascend.register()  # a second call is harmless
    finally:
        DEVICES.unregister("npu")

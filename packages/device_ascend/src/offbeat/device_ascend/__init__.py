"""Ascend NPU support for offbeat: registers the "npu" device in offbeat.core's registry.

Installed, this package declares the entry point `offbeat.devices: npu =
offbeat.device_ascend:register`, so `resources.device=npu` in a job config finds it
without any import in the recipe. `torch_npu` is imported only when the device is
first used; without it, `register()` fails with one line saying what to install.
"""

from __future__ import annotations

from offbeat.device_ascend.device import NpuDevice

__all__ = ["NpuDevice", "register"]

INSTALL_HINT = "the npu device needs torch_npu: install offbeat-device-ascend[npu]"


def register() -> None:
    """Entry-point hook: import torch_npu and register the "npu" device."""
    try:
        import torch_npu  # noqa: F401  (importing it adds torch.npu)
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    from offbeat.core.device import register_device
    from offbeat.core.registry import DEVICES

    if "npu" not in DEVICES.registered():
        register_device(NpuDevice())

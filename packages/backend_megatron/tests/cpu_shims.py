"""Test-only shims for the one Megatron-Core path our CPU tests run that assumes CUDA.

The engine's CPU path needs none (the `torch` optimizer path, core's DCP checkpoints, RoPE
kept on the CPU by the engine). Megatron's dist-checkpointing, which the engine uses on
CUDA, calls CUDA twice on the way: `torch.cuda.synchronize()` after staging the tensors
to write, and `torch.cuda.current_device()` when it finalises the save. To test that path
on a CPU-only machine (CI has no GPU), `patches` makes the first a no-op and the second
answer "cpu". Production code never patches them.
"""

from __future__ import annotations

from typing import Any

import torch


def patches() -> list[tuple[Any, str, Any]]:
    """(object, attribute, replacement) of each shim; none where CUDA is available."""
    if torch.cuda.is_available():
        return []
    return [
        (torch.cuda, "synchronize", lambda *args, **kwargs: None),
        (torch.cuda, "current_device", lambda: "cpu"),
    ]

"""Test-only shims that let megatron-core run on a CPU-only machine (CI has no GPU).

Megatron-Core assumes CUDA in two places our CPU path reaches; production code never
patches them (on CUDA neither is needed, and on CPUs the engine runs what needs no CUDA:
the `torch` optimizer path, PP = 1, core's DCP checkpoints):

1. `torch.cuda.current_device()` picks the device of new tensors (RoPE frequencies, the
   GPT model's buffers): here it answers "cpu".
2. `CudaRNGStatesTracker.fork()` switches CUDA RNG states (dropout under tensor/sequence
   parallelism): here it is a no-op context (our dropout is 0 and there is no CUDA RNG).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


@contextlib.contextmanager
def _fork(self: Any, name: str | None = None):
    yield


def patches() -> list[tuple[Any, str, Any]]:
    """(object, attribute, replacement) of each shim; none where CUDA is available."""
    if torch.cuda.is_available():
        return []
    from megatron.core.tensor_parallel import random as mp_random

    return [
        (torch.cuda, "current_device", lambda: "cpu"),
        (mp_random.CudaRNGStatesTracker, "fork", _fork),
    ]


def apply() -> None:
    """For a worker process that lives only for a test: patch for good."""
    for obj, name, value in patches():
        setattr(obj, name, value)

"""Test-only shims that let megatron-core run on a CPU-only machine (CI has no GPU).

Megatron-Core assumes CUDA in two places our CPU path reaches; production code never
patches them (on CUDA neither is needed, and the engine's CPU path stays honest about what
it runs: the `torch` optimizer, TP = PP = 1):

1. `torch.cuda.current_device()` picks the device of new tensors (RoPE frequencies, the
   GPT model's buffers): here it answers "cpu".
2. `CudaRNGStatesTracker.fork()` switches CUDA RNG states (dropout under tensor/sequence
   parallelism): here it is a no-op context (our dropout is 0 and there is no CUDA RNG).
"""

from __future__ import annotations

import contextlib

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def megatron_on_cpu():
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.tensor_parallel import random as mp_random

    @contextlib.contextmanager
    def fork(self, name=None):
        yield

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        mp.setattr(mp_random.CudaRNGStatesTracker, "fork", fork)
        yield

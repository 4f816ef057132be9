"""Puts this folder on sys.path (the tests and the multi-process worker share
`engine_helpers`), and offers `megatron_cuda_calls_on_cpu`: the test-only shims of
`cpu_shims` (see there for what and why) for the tests that need them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import cpu_shims


@pytest.fixture
def megatron_cuda_calls_on_cpu():
    with pytest.MonkeyPatch.context() as mp:
        for obj, name, value in cpu_shims.patches():
            mp.setattr(obj, name, value)
        yield

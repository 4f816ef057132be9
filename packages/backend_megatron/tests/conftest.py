"""Applies the CPU shims of `cpu_shims` (test-only: see there for what and why) to every
test of this package, and puts this folder on sys.path for the multi-process workers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import cpu_shims


@pytest.fixture(scope="session", autouse=True)
def megatron_on_cpu():
    with pytest.MonkeyPatch.context() as mp:
        for obj, name, value in cpu_shims.patches():
            mp.setattr(obj, name, value)
        yield

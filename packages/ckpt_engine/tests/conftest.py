"""Shared fakes for the checkpoint-engine tests: a model of awkward tensors, an in-process
recording target and a receiver living in a spawned process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Spawned children import their entry points from here (spawn copies sys.path).
sys.path.insert(0, str(Path(__file__).parent))

from ckpt_engine_fakes import RecordingTarget, awkward_model


@pytest.fixture
def model():
    return awkward_model()


@pytest.fixture
def calls():
    return []


@pytest.fixture
def make_target(calls):
    def make(name: str, version: int = 0, **kw) -> RecordingTarget:
        return RecordingTarget(name, calls, version=version, **kw)

    return make

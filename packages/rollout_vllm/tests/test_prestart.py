"""A CPU replica's preloaded forkserver (`_prestart.py`): started only when asked for,
and once; vLLM's engine-core start is routed through a given context (the generic part:
packages/core/tests/test_forkserver.py)."""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import forkserver

import pytest

from offbeat.core.forkserver import ForwardingProcess
from offbeat.rollout_vllm import _prestart, compat


def test_prestart_runs_only_when_asked_and_once(monkeypatch):
    started = []
    monkeypatch.setattr(_prestart, "_started", False)
    monkeypatch.setattr(forkserver, "ensure_running", lambda: started.append(True))
    monkeypatch.setattr(forkserver, "set_forkserver_preload", lambda mods: None)
    monkeypatch.delenv(_prestart.ENV, raising=False)
    assert not _prestart.prestart() and not started
    monkeypatch.setenv(_prestart.ENV, "0")
    assert not _prestart.prestart() and not started
    monkeypatch.setenv(_prestart.ENV, "1")
    assert _prestart.prestart() and started == [True] and _prestart.started()
    assert _prestart.ENV not in os.environ  # the engine's own processes start no other
    monkeypatch.setenv(_prestart.ENV, "1")
    assert not _prestart.prestart() and started == [True]


def test_the_engine_core_start_is_routed_through_the_given_context(monkeypatch):
    utils = pytest.importorskip("vllm.v1.engine.utils")
    monkeypatch.setattr(utils, "get_mp_context", utils.get_mp_context)  # restored after
    ctx = _prestart.ForkServerContext()
    assert compat.engine_core_context(ctx)
    assert utils.get_mp_context() is ctx
    assert utils.get_mp_context().Process is ForwardingProcess
    assert isinstance(ctx.Queue(), type(multiprocessing.get_context("forkserver").Queue()))

"""offbeat.core.compat: every private Ray and torch name it uses still exists upstream, and
each function does what core relies on. An upgrade that moves a name fails here first, by
name (Ray's `ray.init` internals: test_ray_init.py)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from offbeat.core import compat


@pytest.mark.parametrize("name", compat.RAY_NAMES + compat.TORCH_NAMES)
def test_every_private_upstream_name_is_still_there(name):
    module, _, path = name.partition(":")
    obj = importlib.import_module(module)
    for attr in path.split("."):
        if attr == "_parameters":  # an instance attribute of every module
            obj = obj(1, 1) if obj is not nn.Module else nn.Linear(1, 1)
        assert hasattr(obj, attr), f"{name} is gone: offbeat.core.compat relies on it"
        obj = getattr(obj, attr)


def test_no_other_core_module_names_a_private_ray_or_torch_internal():
    from pathlib import Path

    src = Path(compat.__file__).parent
    banned = ("ray._private", "torch._dynamo", "register_parameter =")
    offenders = [
        f"{p.relative_to(src)}: {b}"
        for p in src.rglob("*.py")
        if p.name != "compat.py"
        for b in banned
        if b
        in "\n".join(
            line for line in p.read_text().splitlines() if not line.lstrip().startswith("#")
        )
    ]
    assert not offenders, offenders


def test_the_worker_setup_hook_variable_is_rays():
    from ray._private import ray_constants

    from offbeat.core.process_log import RAY_SETUP_HOOK_ENV

    assert ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR == RAY_SETUP_HOOK_ENV


def test_parameters_on_meta_builds_meta_parameters_and_real_buffers_then_restores():
    original = nn.Module.register_parameter
    with compat.parameters_on_meta():
        lin = nn.Linear(3, 2)
        lin.register_buffer("freq", torch.ones(2))
        emb = nn.Embedding(4, 2)
        tied = nn.Module()
        tied.a = emb
        tied.b_weight = emb.weight  # assigned twice: stays one object
    assert nn.Module.register_parameter is original
    assert lin.weight.device.type == "meta" and lin.bias.device.type == "meta"
    assert lin.freq.device.type == "cpu"
    assert tied.b_weight is emb.weight
    assert nn.Linear(1, 1).weight.device.type == "cpu"  # outside: as before


def test_raise_recompile_limit_only_raises():
    import torch._dynamo

    config = torch._dynamo.config
    before = config.recompile_limit
    try:
        compat.raise_recompile_limit(before + 5)
        assert config.recompile_limit == before + 5
        compat.raise_recompile_limit(1)
        assert config.recompile_limit == before + 5
    finally:
        config.recompile_limit = before

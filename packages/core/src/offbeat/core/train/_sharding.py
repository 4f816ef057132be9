"""Setting up an FSDP2 rank: the process group, and a HF causal LM loaded and sharded
with `fully_shard` (one unit per decoder layer, plus the root).

Knows nothing about training. With several ranks, only rank 0 reads the checkpoint: the
others build a skeleton whose parameters live on the meta device (no memory), and rank 0
broadcasts the weights shard by shard after sharding, so a host holds one full copy of
the model instead of one per rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from offbeat.core import compat
from offbeat.core.device import Device


def ensure_process_group(device: Device) -> torch.device:
    """Join the caller's process group if there is one (torchrun / env:// variables), or
    start a private single-process group (needs no port); return this rank's device."""
    if device.torch_type == "cpu":
        local = torch.device("cpu")
    else:
        module = torch.get_device_module(device.torch_type)
        if "LOCAL_RANK" in os.environ and not dist.is_initialized():
            module.set_device(int(os.environ["LOCAL_RANK"]))
        local = device.torch_device(module.current_device())
    if not dist.is_initialized():
        # Accelerator collectives on the device backend, CPU ones (metrics, object
        # gathers) on gloo.
        backend = (
            device.backend
            if device.torch_type == "cpu"
            else f"cpu:gloo,{device.torch_type}:{device.backend}"
        )
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return local


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: HF's `_no_split_modules` classes."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"cannot find decoder layers in {type(model).__name__}: its _no_split_modules is "
            f"{sorted(names)}; FSDP2 needs the layer class to shard per layer"
        )
    return layers


def hf_config(path: str, trust_remote_code: bool, overrides: Mapping[str, Any] | None = None):
    """The HF config at `path` with `overrides` set on it (as `PretrainedConfig.update`
    does, and vLLM's `hf_overrides`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if overrides:
        config.update(dict(overrides))
    return config


def load_hf_model(
    path: str, trust_remote_code: bool, overrides: Mapping[str, Any] | None = None
) -> nn.Module:
    """The float32 HF causal LM at `path` (a directory or a hub id), on CPU, built from its
    config with `overrides` applied."""
    if not path:
        raise ValueError("train_engine.model_path is empty: give a HF model directory or id")
    from offbeat.core.models.hf import load_causal_lm

    return load_causal_lm(
        path,
        config=hf_config(path, trust_remote_code, overrides),
        dtype=torch.float32,
        trust_remote_code=trust_remote_code,
    )


def _skeleton(path: str, trust_remote_code: bool, overrides: Mapping[str, Any] | None) -> nn.Module:
    from offbeat.core.models.hf import building_models, check_tied, model_class

    config = hf_config(path, trust_remote_code, overrides)
    with building_models(), compat.parameters_on_meta():
        model = model_class(config).from_config(
            config, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
    check_tied(model, path)
    return model


def shard(
    model: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    gradient_checkpointing: bool,
    compile_layers: bool = False,
    *,
    offload: bool = False,
) -> nn.Module:
    """`fully_shard` each decoder layer, then the root (in place; returns the model).
    `compile_layers`: torch.compile each layer's forward (FSDP's hooks stay outside the
    compiled code, and parameter names do not change). `offload`: parameters stay in host
    memory between uses (CPUOffloadPolicy)."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs: dict[str, Any] = {
        "mesh": mesh, "mp_policy": mp_policy, "reshard_after_forward": reshard_after_forward
    }  # fmt: skip
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    layers = decoder_layers(model)
    if compile_layers:
        _compile_forwards(layers)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _compile_forwards(layers: list[nn.Module]) -> None:
    """One compiled graph serves every layer of the same class (their parameters are
    inputs, not constants); room is made so that a recompile per layer, should the guards
    ask for one, does not fall back to eager after the default 8."""
    compat.raise_recompile_limit(2 * len(layers) + 8)
    for layer in layers:
        layer.forward = torch.compile(layer.forward)


def build_sharded_model(
    path: str,
    mesh: DeviceMesh,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy,
    *,
    reshard_after_forward: bool = True,
    gradient_checkpointing: bool = False,
    compile_layers: bool = False,
    trust_remote_code: bool = False,
    init_on_rank0: bool = True,
    override_config: Mapping[str, Any] | None = None,
    offload: bool = False,
) -> nn.Module:
    """Load the HF model at `path` (its config with `override_config` applied) and shard it
    over `mesh`. With several ranks and `init_on_rank0`, rank 0 alone reads the checkpoint
    and broadcasts it."""
    group = mesh.get_group()
    opts = (reshard_after_forward, gradient_checkpointing, compile_layers)
    ov = override_config
    if dist.get_world_size(group) == 1 or not init_on_rank0:
        model = load_hf_model(path, trust_remote_code, ov).float()
        return shard(model, mesh, mp_policy, *opts, offload=offload)
    full_state = {}
    if dist.get_rank(group) == 0:
        full_state = load_hf_model(path, trust_remote_code, ov).state_dict()
    model = shard(_skeleton(path, trust_remote_code, ov), mesh, mp_policy, *opts, offload=offload)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=torch.device("cpu") if offload else device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    set_model_state_dict(
        model,
        full_state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    return model

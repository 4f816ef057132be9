"""Atomic save/load of the Megatron engine.

Knows nothing about the trainer's step checkpoints. On the ``megatron`` optimizer path
(CUDA) a checkpoint is Megatron's dist-checkpointing: ``dist/`` holds the model's and the
distributed optimizer's sharded state dicts (resharding-aware), ``engine_state.pt`` the
update count, written last so its presence marks a complete checkpoint. Every rank writes
into ``<path>.tmp``; rank 0 renames it to ``<path>``. On the ``torch`` path (PP = 1, any
device) it is core's DCP checkpoint of the plain model and its AdamW + LR schedule
(`offbeat.core.train._checkpoint`): Megatron's writer synchronises CUDA after staging,
which a CPU host cannot.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from offbeat.core.train import _checkpoint as core_checkpoint

EXTRA_FILE = core_checkpoint.EXTRA_FILE
_DIST = "dist"


def _sharded(model: torch.nn.Module, opt: Any, with_optim: bool, loading: bool) -> dict[str, Any]:
    state: dict[str, Any] = {"model": model.sharded_state_dict()}
    if with_optim:
        state["optimizer"] = opt.optimizer.sharded_state_dict(state["model"], is_loading=loading)
    return state


def save(path: str, model: torch.nn.Module, opt: Any, extra: dict[str, Any]) -> None:
    """Collective over all ranks. `model` is the unwrapped Megatron model."""
    from megatron.core import dist_checkpointing

    if opt.kind == "torch":
        sched = {"lr_scheduler": opt.scheduler.state_dict()}
        core_checkpoint.save(path, model, opt.optimizer, {**extra, **sched})
        return

    tmp = core_checkpoint.begin(path)  # core's atomic write: tmp dir, extra last, rename
    os.makedirs(os.path.join(tmp, _DIST), exist_ok=True)
    # An optimizer that never stepped has no state; asking for it would create a zero step.
    has_optim = opt.has_state
    dist_checkpointing.save(_sharded(model, opt, has_optim, False), os.path.join(tmp, _DIST))
    core_checkpoint.commit(path, tmp, extra, has_optim)


is_complete = core_checkpoint.is_complete


def load(path: str, model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    """Restore model (+ optimizer) from `path` in place; return the extra state."""
    from megatron.core import dist_checkpointing

    if opt.kind == "torch":
        extra = core_checkpoint.load(path, model, opt.optimizer)
        opt.scheduler.load_state_dict(extra.pop("lr_scheduler"))
        return extra
    path = os.path.abspath(path)
    extra, has_optim = core_checkpoint.read_extra(path)
    if not has_optim and opt.has_state:
        raise ValueError(
            f"checkpoint {path!r} was saved before any update (no optimizer state) but this "
            "engine has already updated: load it into a fresh engine"
        )
    state = dist_checkpointing.load(
        _sharded(model, opt, has_optim, True), os.path.join(path, _DIST)
    )
    model.load_state_dict(state["model"])
    if has_optim:
        opt.optimizer.load_state_dict(state["optimizer"])
    else:  # the float32 master weights are copies of the model's: refresh them
        opt.optimizer.reload_model_params()
    return extra

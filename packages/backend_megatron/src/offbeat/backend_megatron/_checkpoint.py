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
import shutil
from typing import Any

import torch
import torch.distributed as dist

from offbeat.core.train import _checkpoint as core_checkpoint

EXTRA_FILE = "engine_state.pt"
_DIST = "dist"
_HAS_OPTIM = "has_optimizer_state"


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

    path = os.path.abspath(path).rstrip(os.sep)
    tmp = path + ".tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, _DIST))
    dist.barrier()
    # An optimizer that never stepped has no state; asking for it would create a zero step.
    has_optim = opt.has_state
    dist_checkpointing.save(_sharded(model, opt, has_optim, False), os.path.join(tmp, _DIST))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, EXTRA_FILE), "wb") as f:
            torch.save({**extra, _HAS_OPTIM: has_optim}, f)
            f.flush()
            os.fsync(f.fileno())
        old = path + ".old"
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, EXTRA_FILE))


def load(path: str, model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    """Restore model (+ optimizer) from `path` in place; return the extra state."""
    from megatron.core import dist_checkpointing

    if opt.kind == "torch":
        extra = core_checkpoint.load(path, model, opt.optimizer)
        opt.scheduler.load_state_dict(extra.pop("lr_scheduler"))
        return extra
    path = os.path.abspath(path)
    if not is_complete(path):
        raise FileNotFoundError(
            f"no complete train-engine checkpoint at {path!r} (missing {EXTRA_FILE})"
        )
    with open(os.path.join(path, EXTRA_FILE), "rb") as f:
        extra = torch.load(f, weights_only=True)
    has_optim = bool(extra.pop(_HAS_OPTIM, True))
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

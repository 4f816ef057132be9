"""Sharded, atomic save/load of a sharded model and its optimizer with
torch.distributed.checkpoint (DCP), plus a small picklable extra state (LR schedule,
update count) and each rank's RNG states (torch, CUDA, Python, NumPy), one file per rank.

Knows nothing about the trainer's step checkpoints, dataloaders or replay buffers. Every
rank writes its own shards into `<path>.tmp`; rank 0 then renames it to `<path>`, so a
reader only ever sees a complete checkpoint (the marker file is written last).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

EXTRA_FILE = "engine_state.pt"
_HAS_OPTIM = "has_optimizer_state"
_RNG_FILE = "rng_rank{rank}.pt"

log = logging.getLogger(__name__)


def rank_rng_state() -> dict[str, Any]:
    """This process's RNG states: torch (CPU, and every CUDA device when there is one),
    Python's `random`, NumPy's global generator."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rank_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin(path: str, group: dist.ProcessGroup | None = None) -> str:
    """Start an atomic checkpoint write of `path`: rank 0 makes a fresh `<path>.tmp`,
    which every rank of `group` then writes its shards into. Returns that directory.
    Collective; `commit` ends it."""
    tmp = os.path.abspath(path).rstrip(os.sep) + ".tmp"
    if dist.get_rank(group) == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier(group=group)
    return tmp


def commit(
    path: str, tmp: str, extra: dict[str, Any], has_optim: bool,
    group: dist.ProcessGroup | None = None,
) -> None:  # fmt: skip
    """End the write `begin` started, once every rank wrote its shards: rank 0 writes
    `extra` (its presence marks the checkpoint complete), syncs it to disk and renames
    the directory over `path`. Collective. The engines share it (FSDP2's DCP shards and
    Megatron's dist-checkpointing ones)."""
    path = os.path.abspath(path).rstrip(os.sep)
    dist.barrier(group=group)
    if dist.get_rank(group) == 0:
        with open(os.path.join(tmp, EXTRA_FILE), "wb") as f:
            torch.save({**extra, _HAS_OPTIM: has_optim}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        old = path + ".old"
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(os.path.dirname(path))
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)


def read_extra(path: str) -> tuple[dict[str, Any], bool]:
    """(the extra state, whether the optimizer's state was saved) of the complete
    checkpoint at `path`; FileNotFoundError when there is none."""
    path = os.path.abspath(path)
    if not is_complete(path):
        raise FileNotFoundError(
            f"no complete train-engine checkpoint at {path!r} (missing {EXTRA_FILE})"
        )
    with open(os.path.join(path, EXTRA_FILE), "rb") as f:
        extra = torch.load(f, weights_only=True)
    return extra, bool(extra.pop(_HAS_OPTIM, True))


def save(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Write model + optimizer shards and `extra` to directory `path`, replacing it.
    Collective: every rank of `group` calls it."""
    tmp = begin(path, group)
    # An optimizer that never stepped has no state; asking DCP for its state dict would
    # create it with a zero step (and so change the next update): save the model alone.
    has_optim = bool(optimizer.state)
    if has_optim:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    dcp.save(state, checkpoint_id=tmp, process_group=group)
    torch.save(rank_rng_state(), os.path.join(tmp, _RNG_FILE.format(rank=dist.get_rank(group))))
    commit(path, tmp, extra, has_optim, group)


def is_complete(path: str) -> bool:
    """True when `path` holds a checkpoint whose write finished."""
    return os.path.isfile(os.path.join(path, EXTRA_FILE))


def load(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Restore model + optimizer from `path` in place and return the extra state.
    Collective: every rank of `group` calls it."""
    path = os.path.abspath(path)
    extra, has_optim = read_extra(path)
    if has_optim:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path, process_group=group)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    else:
        if optimizer.state:
            raise ValueError(
                f"checkpoint {path!r} was saved before any update (no optimizer state) but "
                "this engine has already updated: load it into a fresh engine"
            )
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path, process_group=group)
        set_model_state_dict(model, state["model"])
    _load_rank_rng(path, dist.get_rank(group))
    return extra


def _load_rank_rng(path: str, rank: int) -> None:
    """Restore this rank's RNG states, when the checkpoint holds them (one saved with as
    many ranks or more, after RNG states were saved)."""
    rng_path = os.path.join(path, _RNG_FILE.format(rank=rank))
    if not os.path.isfile(rng_path):
        log.warning(
            "checkpoint %s holds no RNG state for rank %d: its RNG starts afresh", path, rank
        )
        return
    set_rank_rng_state(torch.load(rng_path, weights_only=False))

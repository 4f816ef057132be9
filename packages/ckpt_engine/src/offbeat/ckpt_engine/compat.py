"""Every use of torch.distributed's internals in offbeat.ckpt_engine, in one place.

The `broadcast` backend builds a process group of its own (never the default one) straight
from c10d's classes, which needs two private names: the NCCL options' `_timeout` and the
registry of third-party backends, `dist.Backend._plugins`. `tests/test_compat.py` fails
when an upgrade moves one. Knows nothing of buckets or syncs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["broadcast", "new_process_group", "process_group_backend"]


def process_group_backend(device: torch.device) -> str:
    """The torch.distributed backend of `device`'s type: gloo, nccl, or the one a device
    plugin registered (`dist.Backend.default_device_backend_map`)."""
    if device.type == "cpu":
        return "gloo"
    if device.type == "cuda":
        return "nccl"
    name = dist.Backend.default_device_backend_map.get(device.type)
    if name is None:
        raise ValueError(f"broadcast: no torch.distributed backend for device type {device.type!r}")
    return name


def new_process_group(
    store: dist.Store, key: str, backend: str, rank: int, world: int, timeout_s: float
) -> Any:
    """A process group of `world` ranks over `store` (keys under `pg/<key>/`), built from
    c10d's backend classes: not registered with torch.distributed, never the default."""
    prefix = dist.PrefixStore(f"pg/{key}/", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, world, opts)
    plugin = dist.Backend._plugins.get(backend.upper())
    if plugin is None:
        raise ValueError(f"broadcast: torch.distributed backend {backend!r} is not registered")
    return plugin.creator_fn(prefix, rank, world, timeout)


def broadcast(pg: Any, tensor: torch.Tensor, root: int) -> Any:
    """`tensor` from rank `root` to every rank of `pg` (a work handle: `.wait()`)."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    return pg.broadcast([tensor], opts)

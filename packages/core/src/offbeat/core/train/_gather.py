"""Gathering a sharded model's parameters whole onto ONE rank (the sender of a weight
sync), one parameter at a time.

An all-gather (`DTensor.full_tensor`) gives every rank the full tensor; a weight sync needs
it on the sender alone. Here every other rank sends its row block of each parameter to
`dst` with point-to-point sends (cast to the export dtype first), and `dst` receives them
straight into the rows of the full tensor, which it yields. The sends are posted without
waiting (a bounded window of them in flight), so on a GPU the transfers run on the
collective stream while the sender packs and broadcasts earlier parameters. Knows nothing
about buckets, receivers or checkpoint engines.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

# Sends a non-destination rank keeps in flight (each holds its cast shard until done).
_SEND_WINDOW = 8


def row_blocks(rows: int, world: int) -> list[tuple[int, int]]:
    """Each rank's [start, stop) rows of a dim-0 shard, as `torch.chunk` cuts them (the
    layout of FSDP2's `Shard(0)`): ceil(rows / world) rows each, the last ones short or
    empty."""
    size = -(-rows // world) if rows else 0
    return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(world)]


def _is_row_sharded(param: torch.Tensor) -> bool:
    return (
        isinstance(param, DTensor)
        and len(param.placements) == 1
        and isinstance(param.placements[0], Shard)
        and param.placements[0].dim == 0
    )


@torch.no_grad()
def gather_to(
    model: nn.Module,
    group: dist.ProcessGroup,
    dst: int,
    dtype: torch.dtype | None,
    prefetch_bytes: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full contiguous tensor) for every parameter on group rank `dst`, nothing on the
    others; every rank must iterate to the end. `dst` posts the receives of the parameters
    after the one it yields until `prefetch_bytes` of them are in flight (0: none, so it
    holds one full parameter at a time). Parameters not sharded by rows (other placements,
    plain tensors) are gathered with `full_tensor` / taken as they are."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if not 0 <= dst < world:
        raise ValueError(f"gather_to: dst={dst} is not a rank of a group of {world}")
    peer = [dist.get_global_rank(group, r) for r in range(world)]
    if rank != dst:
        _send_all(model, group, peer[dst], rank, world, dtype)
        return
    ahead: deque[tuple[str, torch.Tensor, list[dist.Work]]] = deque()
    ahead_bytes = 0
    params = iter(model.named_parameters())
    done = False
    while True:
        # Post receives until one parameter plus `prefetch_bytes` are in flight.
        while not done and (not ahead or ahead_bytes < prefetch_bytes):
            item = next(params, None)
            if item is None:
                done = True
                break
            name, param = item
            full, works = _post_receive(name, param, group, peer, rank, world, dtype)
            ahead.append((name, full, works))
            ahead_bytes += full.numel() * full.element_size()
        if not ahead:
            return
        name, full, works = ahead.popleft()
        ahead_bytes -= full.numel() * full.element_size()
        for w in works:
            w.wait()  # on a GPU: the current stream waits, the host does not
        yield name, full
        del full


def _local(param: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    local = param.to_local() if isinstance(param, DTensor) else param.detach()
    return local.to(dtype) if dtype is not None and local.dtype != dtype else local


def _check_rows(name: str, local: torch.Tensor, block: tuple[int, int], rows: int, rank: int):
    if local.shape[0] != block[1] - block[0]:
        raise RuntimeError(
            f"gather_to: {name}'s shard on rank {rank} has {local.shape[0]} rows, "
            f"expected {block[1] - block[0]} of {rows} (torch.chunk layout)"
        )


def _whole(param: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A parameter not sharded by rows, whole (a collective for a DTensor)."""
    full = param.to(dtype) if dtype is not None and param.dtype != dtype else param
    full = full.full_tensor() if isinstance(full, DTensor) else full.detach()
    return full.contiguous()


def _post_receive(name, param, group, peer, rank, world, dtype):
    """On the destination: the full tensor of one parameter, its own rows copied in and
    the receives of the other ranks' rows posted (not waited for)."""
    if not _is_row_sharded(param):
        return _whole(param, dtype), []
    local = _local(param, dtype)
    blocks = row_blocks(param.shape[0], world)
    _check_rows(name, local, blocks[rank], param.shape[0], rank)
    full = torch.empty(param.shape, dtype=local.dtype, device=local.device)
    works = []
    for r, (a, b) in enumerate(blocks):
        if b <= a:
            continue
        if r == rank:
            full[a:b].copy_(local)
        else:
            works.append(dist.irecv(full[a:b], src=peer[r], group=group))
    return full, works


def _send_all(model, group, dst_global, rank, world, dtype) -> None:
    """On every other rank: send each parameter's rows to the destination, a bounded
    window of sends in flight."""
    pending: deque[tuple[dist.Work, torch.Tensor]] = deque()
    for name, param in model.named_parameters():
        if not _is_row_sharded(param):
            _whole(param, dtype)  # a collective: every rank takes part
            continue
        local = _local(param, dtype)
        block = row_blocks(param.shape[0], world)[rank]
        _check_rows(name, local, block, param.shape[0], rank)
        if block[1] > block[0]:
            local = local.contiguous()
            pending.append((dist.isend(local, dst=dst_global, group=group), local))
        while len(pending) > _SEND_WINDOW:
            pending.popleft()[0].wait()
    while pending:
        pending.popleft()[0].wait()

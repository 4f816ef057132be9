"""cuda_ipc round trips between processes on one GPU (skipped without CUDA). Plain functions
around asyncio.run, so they need no asyncio plugin on a GPU machine."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch
from ckpt_engine_fakes import BUCKET, ProcessTarget, digest

from offbeat.ckpt_engine import CheckpointEngineManager, get_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda_ipc needs a CUDA device"),
]


def _sync_thrice(model: dict[str, torch.Tensor], backend, checksum: bool = True) -> None:
    """Three syncs with an in-place update of every float tensor before each (a trainer's
    step): the first packs, later ones may read the same storages in place and must deliver
    that sync's values (without a checksum, buckets read wholly in place are neither acked
    nor re-planned: the second sync plans them, the third replays them)."""
    ctx = mp.get_context("spawn")
    targets = {"g0": ProcessTarget(ctx), "g1": ProcessTarget(ctx)}
    mgr = CheckpointEngineManager(
        backend, bucket_bytes=BUCKET, phase_timeout_s=120, checksum=checksum
    )

    async def run() -> None:
        for version in (1, 2, 3):
            for t in model.values():
                if t.is_floating_point():
                    t.add_(1)
            res = await mgr.sync(model.items(), version, targets)
            assert res.failed == {}, res.failed
            for t in targets.values():
                assert t.weight_version == version
                assert t.last_digest == {n: digest(x) for n, x in model.items()}

    try:
        asyncio.run(run())
    finally:
        mgr.close()
        for t in targets.values():
            t.close()


def test_cuda_ipc_packed_round_trip(model):
    _sync_thrice({n: t.cuda() for n, t in model.items()}, "cuda_ipc")


def test_cuda_ipc_packing_only_round_trip(model):
    _sync_thrice(
        {n: t.cuda() for n, t in model.items()}, get_backend("cuda_ipc")(zero_copy_min_bytes=None)
    )


def test_cuda_ipc_separate_in_place_no_checksum_round_trip(model):
    _sync_thrice({n: t.cuda() for n, t in model.items()}, "cuda_ipc", checksum=False)


@pytest.mark.parametrize("checksum", [True, False])
def test_cuda_ipc_in_place_round_trip(model, checksum):
    """Tensors that are views of one storage are read in place by the receivers."""
    tensors = [t.cuda().contiguous() for t in model.values()]
    sizes = [t.numel() * t.element_size() for t in tensors]
    pad = [(s + 255) // 256 * 256 for s in sizes]
    flat = torch.zeros(sum(pad), dtype=torch.uint8, device="cuda")
    views, off = {}, 0
    for (name, src), n, p in zip(model.items(), sizes, pad, strict=True):
        v = (
            flat[off : off + n].view(src.dtype).view(src.shape)
            if n
            else torch.empty(src.shape, dtype=src.dtype, device="cuda")
        )
        v.copy_(src)
        views[name] = v
        off += p
    _sync_thrice(views, get_backend("cuda_ipc")(zero_copy_min_bytes=0), checksum=checksum)

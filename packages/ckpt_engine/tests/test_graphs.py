"""GraphedCopies: copies seen before replayed as a CUDA graph must deliver exactly what
eager copies would, every time (CUDA tests skipped without a device); off the GPU it
declines and the loader copies as before."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch
from ckpt_engine_fakes import ProcessTarget, digest

from offbeat.ckpt_engine import CheckpointEngineManager, copy_into
from offbeat.ckpt_engine._graphs import KERNEL_MIN_BYTES, GraphedCopies
from offbeat.ckpt_engine.bucket import copy_many

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_declines_host_tensors():
    g = GraphedCopies()
    d, s = [torch.zeros(4)], [torch.ones(4)]
    assert g(d, s) is False and g(d, s) is False  # never on the host
    assert not d[0].any()  # declining copies nothing: the caller does


def test_copy_into_without_graphs_on_the_host():
    params = {"w": torch.zeros(3)}
    load = copy_into(params, graphs=False)
    for v in (1.0, 2.0):
        load([("w", torch.full((3,), v))])
        assert torch.equal(params["w"], torch.full((3,), v))


def _pairs(device: str = "cuda") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    big = KERNEL_MIN_BYTES // 4 + 13
    shapes = [
        ((big,), torch.float32),  # a kernel copy in int32 words
        ((big * 2 + 1,), torch.bfloat16),  # odd element count: int16 words
        ((KERNEL_MIN_BYTES + 3,), torch.uint8),  # odd byte count: bytes
        ((7, 5), torch.float16),  # small: the fused copy
        ((1,), torch.int64),
        ((0, 3), torch.float32),  # empty
        ((), torch.float32),  # 0-dim
        ((big,), torch.bool),
    ]
    dsts = [torch.zeros(s, dtype=dt, device=device) for s, dt in shapes]
    srcs = [torch.zeros(s, dtype=dt, device=device) for s, dt in shapes]
    return dsts, srcs


def _refill(srcs: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator(device=srcs[0].device).manual_seed(seed)
    for s in srcs:
        if s.numel():
            bits = torch.randint(0, 256, (s.nbytes,), generator=g, device=s.device)
            s.view(-1).view(torch.uint8).copy_(bits.to(torch.uint8))


@cuda
def test_replays_deliver_each_calls_bytes():
    dsts, srcs = _pairs()
    g = GraphedCopies()
    used = []
    for step in range(5):
        _refill(srcs, step)
        took = g(dsts, srcs)
        if not took:
            copy_many(dsts, srcs)
        used.append(took)
        torch.cuda.synchronize()
        for d, s in zip(dsts, srcs, strict=True):
            assert torch.equal(d.view(-1).view(torch.uint8), s.view(-1).view(torch.uint8))
    assert used == [False, True, True, True, True]  # captured on the second sight
    assert g.disabled is None


@cuda
def test_unaligned_source_and_other_stream():
    """A source at an odd offset (words of different widths on the two sides) and a replay
    queued on a non-default stream."""
    n = KERNEL_MIN_BYTES + 64
    raw = torch.zeros(n + 2, dtype=torch.uint8, device="cuda")
    src = raw[2:].view(torch.int16)  # 2-byte aligned only
    dst = torch.zeros(n // 2, dtype=torch.int16, device="cuda")
    g = GraphedCopies()
    stream = torch.cuda.Stream()
    for step in range(3):
        _refill([raw], step)
        with torch.cuda.stream(stream):
            if not g([dst], [src]):
                dst.copy_(src)
        stream.synchronize()
        assert torch.equal(dst, src)


@cuda
def test_declines_what_it_cannot_replay():
    g = GraphedCopies(max_graphs=1)
    a = torch.zeros(4, 4, device="cuda")
    b = torch.ones(4, 4, device="cuda")
    assert g([a], [b.t()]) is False and g([a], [b.t()]) is False  # not contiguous
    assert g([a.cpu()], [b.cpu()]) is False
    c = torch.zeros(4, 4, device="cuda")
    # Two alternating sets with room for one: each evicts the other, never replayed.
    for _ in range(3):
        assert g([a], [b]) is False
        assert g([c], [b]) is False
    # Same pairs twice in a row: replayed.
    assert g([a], [b]) is False and g([a], [b]) is True


@cuda
def test_copy_into_replays_across_cuda_ipc_syncs():
    """Four syncs into a model kept by the receiver, with the sender's tensors updated in
    place between them: from the third sync on, buckets are read in place and their copies
    replayed as graphs, and every sync must land that step's values."""
    g = torch.Generator(device="cuda").manual_seed(0)
    big = KERNEL_MIN_BYTES // 2 + 5
    model = {
        "w.0": torch.randn(big, generator=g, device="cuda").to(torch.bfloat16),
        "w.1": torch.randn(3, big // 3 + 1, generator=g, device="cuda"),
        "b.0": torch.randn(17, generator=g, device="cuda"),
        "m": torch.rand(big, generator=g, device="cuda") > 0.5,
    }
    into = {n: (tuple(t.shape), t.dtype, "cuda") for n, t in model.items()}
    ctx = mp.get_context("spawn")
    target = ProcessTarget(ctx, into=into)
    mgr = CheckpointEngineManager("cuda_ipc", bucket_bytes=4 << 20, phase_timeout_s=120)

    async def run() -> None:
        for version in (1, 2, 3, 4):
            for t in model.values():
                if t.is_floating_point():
                    t.add_(1)
                else:
                    t.logical_not_()
            res = await mgr.sync(model.items(), version, {"r": target})
            assert res.failed == {}, res.failed
            assert target.last_digest == {n: digest(x) for n, x in model.items()}

    try:
        asyncio.run(run())
    finally:
        mgr.close()
        target.close()

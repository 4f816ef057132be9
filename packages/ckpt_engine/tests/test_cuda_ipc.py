"""cuda_ipc round trip between processes on one GPU (skipped without CUDA)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from ckpt_engine_fakes import BUCKET, ProcessTarget, digest

from offbeat.ckpt_engine import CheckpointEngineManager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda_ipc needs a CUDA device"),
]


async def test_cuda_ipc_round_trip_to_another_process(model):
    gpu_model = {n: t.cuda() for n, t in model.items()}
    ctx = mp.get_context("spawn")
    targets = {"g0": ProcessTarget(ctx), "g1": ProcessTarget(ctx)}
    mgr = CheckpointEngineManager(
        "cuda_ipc", bucket_bytes=BUCKET, phase_timeout_s=120, checksum=True
    )
    try:
        for version in (1, 2):
            res = await mgr.sync(gpu_model.items(), version, targets)
            assert res.failed == {}, res.failed
            for t in targets.values():
                assert t.last_digest == {n: digest(x) for n, x in model.items()}
    finally:
        mgr.close()
        for t in targets.values():
            t.close()

"""separate_async end to end on ONE CUDA GPU through the real job (`run_job`: Ray, the
balancer, the checkpoint-engine manager): the trainer in the driver and one vLLM replica (a
Ray actor) share the GPU (`runtime.share_trainer_gpu`), the replica taking
`rollout.engine_kwargs.gpu_memory_utilization=0.3` of it; weights travel by `cuda_ipc`. The
default task and tiny model (warm start included) learn: the greedy validation reward of the
last version beats version 0. Skipped without CUDA (marker gpu: never in CPU CI)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.ray,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(900),
]

STEPS = 30
MARGIN = 0.06  # as the CPU test of the default job (4 more of the 64 prompts right)
ONE_GPU = [
    "resources.device=cuda",
    "resources.devices_per_node=2",  # the trainer's device is counted; one GPU holds both
    "resources.trainer_devices=1",
    "resources.rollout_devices=1",
    "runtime.share_trainer_gpu=true",
    "rollout.engine_kwargs.gpu_memory_utilization=0.3",
    "runtime.rollout_num_gpus=1",
    "runtime.rollout_num_cpus=2",
    "runtime.ray_num_cpus=8",
    "runtime.trainer_cpus=[]",
    "runtime.rollout_cpus=[]",
    "runtime.trainer_threads=4",
    "runtime.ckpt_backend=cuda_ipc",
    "runtime.rollout_env={VLLM_LOGGING_LEVEL: WARNING}",
    "runtime.progress_bar=false",
]


def test_separate_async_learns_on_one_shared_gpu(tmp_path):
    import ray

    from offbeat.core.cli import load_recipe_config
    from offbeat.core.trainer.job import run_job
    from offbeat.rollout_vllm.replica import register

    register()  # also where the packages are on PYTHONPATH only (no entry points)

    extra = os.environ.get("OFFBEAT_GPU_TEST_OVERRIDES", "").split()  # e.g. model.dtype=...
    _, cfg = load_recipe_config(
        "separate_async",
        [
            *ONE_GPU,
            f"trainer.total_training_steps={STEPS}",
            "trainer.test_freq=10",
            "trainer.save_freq=-1",
            f"trainer.log_dir={tmp_path}",
            "trainer.loggers=[jsonl]",
            *extra,
        ],
    )
    try:
        summary = asyncio.run(run_job(cfg))
    finally:
        ray.shutdown()
    rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    print("val_history", summary["val_history"])
    print("sync/gbps", [round(r["sync/gbps"], 2) for r in train if "sync/gbps" in r])
    assert summary["steps"] == STEPS
    assert summary["counts"]["failed"] == 0
    # The trainer ran on the GPU the replica uses (the only one) and synced over CUDA IPC.
    assert torch.cuda.current_device() == 0 and torch.cuda.max_memory_allocated() > 0
    assert max(r["sync/bytes"] for r in train) > 0
    (v0, before), *_, (last, after) = summary["val_history"]
    assert (v0, last) == (0, STEPS)
    assert after - before >= MARGIN, summary["val_history"]

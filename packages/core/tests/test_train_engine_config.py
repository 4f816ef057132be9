"""Train-engine plumbing without heavy training: the LR schedule, config checks and their
messages, building from a JobConfig, batch input forms, metric reduction, the Ray shell."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from offbeat.core.config import JobConfig
from offbeat.core.data import Trajectory, TrajectoryBatch
from offbeat.core.models import build_tiny_model
from offbeat.core.train import (
    FSDP2Config,
    FSDP2TrainEngine,
    OptimConfig,
    PPOLoss,
    PPOLossConfig,
    TrainEngine,
    actor_engine_config,
    build_actor_engine,
    lr_factor,
    make_train_engine_actor,
    ppo_loss_config,
)
from offbeat.core.train._metrics import MetricSums


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )


@pytest.fixture(scope="module", autouse=True)
def _own_process_group():
    existed = dist.is_initialized()
    yield
    if not existed and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------ LR schedule
def test_lr_factor_warmup_then_constant():
    c = OptimConfig(lr=1.0, warmup_updates=4)
    assert [lr_factor(c, u) for u in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_lr_factor_cosine_reaches_the_floor_at_the_horizon_and_stays():
    c = OptimConfig(lr_schedule="cosine", warmup_updates=2, total_updates=10, min_lr_ratio=0.1)
    assert lr_factor(c, 0) == 0.5 and lr_factor(c, 2) == pytest.approx(1.0)
    assert lr_factor(c, 6) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert lr_factor(c, 10) == pytest.approx(0.1) and lr_factor(c, 50) == pytest.approx(0.1)
    values = [lr_factor(c, u) for u in range(2, 11)]
    assert values == sorted(values, reverse=True)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"lr": 0.0}, "optim.lr"),
        ({"lr_schedule": "linear"}, "optim.lr_schedule"),
        ({"lr_schedule": "cosine", "total_updates": 0}, "optim.total_updates"),
        ({"betas": [0.9]}, "optim.betas"),
        ({"min_lr_ratio": 2.0}, "optim.min_lr_ratio"),
    ],
)
def test_optim_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        OptimConfig(**kwargs).validate()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"micro_batch_size": 0}, "train_engine.micro_batch_size=0"),
        ({"param_dtype": "fp8"}, r"train_engine.param_dtype='fp8'.*bfloat16"),
        ({"temperature": 0.0}, "train_engine.temperature"),
    ],
)
def test_engine_config_errors_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FSDP2Config(**kwargs).validate()


def test_loss_config_errors_list_the_choices():
    with pytest.raises(ValueError, match=r"loss.loss_agg_mode='mean'.*token-mean"):
        PPOLoss(PPOLossConfig(loss_agg_mode="mean"))
    with pytest.raises(ValueError, match=r"loss.rollout_is_level='seq'.*sequence"):
        PPOLoss(PPOLossConfig(rollout_is_level="seq"))
    with pytest.raises(ValueError, match=r"loss.kl_loss_type='k9'.*k3"):
        PPOLoss(PPOLossConfig(use_kl_loss=True, kl_loss_type="k9"))


# ------------------------------------------------------------------ JobConfig
def job_config(model_dir) -> JobConfig:
    job = JobConfig()
    job.model.path = str(model_dir)
    job.actor = replace(job.actor, lr=2e-3, lr_warmup_steps=2, ppo_epochs=2)
    job.actor.ppo_micro_batch_size_per_device = 3
    job.rollout.temperature = 0.8
    job.rollout.max_tokens = 40
    job.trainer.total_training_steps = 5
    job.async_training.parameter_sync_step = 3
    job.algorithm.loss_agg_mode = "seq-mean-token-sum-norm"
    return job


def test_from_job_config_maps_the_keys(model_dir):
    job = job_config(model_dir)
    c = actor_engine_config(job)
    assert (c.model_path, c.micro_batch_size, c.temperature) == (str(model_dir), 3, 0.8)
    assert (c.device, c.param_dtype, c.export_dtype) == ("cpu", "float32", "float32")
    assert (c.optim.lr, c.optim.warmup_updates) == (2e-3, 2)
    assert c.optim.total_updates == 5 * 3 * 2  # steps x parameter_sync_step x epochs
    loss = ppo_loss_config(job)
    assert loss.loss_agg_mode == "seq-mean-token-sum-norm" and loss.horizon == 40.0
    assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.clip_ratio_c) == (0.2, 0.2, 3.0)


def test_model_override_config_reaches_the_built_model(model_dir):
    job = job_config(model_dir)
    plain = build_actor_engine(job).model
    job.model.override_config = {"rms_norm_eps": 0.5, "attention_dropout": 0.25}
    assert actor_engine_config(job).override_config == job.model.override_config
    model = build_actor_engine(job).model
    assert (model.config.rms_norm_eps, model.config.attention_dropout) == (0.5, 0.25)
    assert plain.config.rms_norm_eps != 0.5
    # ...and the model is built from it: the final norm uses the overridden epsilon.
    assert model.model.norm.variance_epsilon == 0.5 != plain.model.norm.variance_epsilon


def test_build_actor_engine_reads_trajectory_batches_and_follows_the_schedule(model_dir):
    job = job_config(model_dir)
    engine = build_actor_engine(job)
    assert isinstance(engine, FSDP2TrainEngine) and isinstance(engine, TrainEngine)
    g = torch.Generator().manual_seed(0)
    trajectories = [
        Trajectory(
            prompt_ids=torch.randint(1, 200, (2 + i % 3,), generator=g).tolist(),
            response_ids=torch.randint(1, 200, (1 + i,), generator=g).tolist(),
            rollout_log_probs=[-1.0] * (1 + i),
            group_uid=f"g{i // 2}",
            extras={"advantages": [0.5 - i % 2] * (1 + i)},
        )
        for i in range(4)
    ]
    batch = TrajectoryBatch.pad(trajectories)
    from_batch = engine.compute_log_probs(batch)  # at the configured temperature 0.8
    from_dict = engine.compute_log_probs(batch.model_inputs(), temperature=0.8)
    assert torch.equal(from_batch, from_dict)
    assert not torch.equal(from_batch, engine.compute_log_probs(batch, temperature=1.0))
    lrs = []
    for _ in range(3):
        metrics = engine.update(batch)  # bypass mode: old = rollout log-probs
        lrs.append(metrics["actor/lr"])
    assert lrs == pytest.approx([1e-3, 2e-3, 2e-3])  # 2 warm-up updates
    assert engine.global_update_count == 3 and metrics["actor/num_tokens"] == 10


def test_bypass_mode_equals_old_log_probs_from_the_rollout(model_dir):
    def run(with_old: bool) -> dict:
        config = FSDP2Config(model_path=str(model_dir), device="cpu", optim=OptimConfig(lr=1e-2))
        engine = FSDP2TrainEngine(config, PPOLoss(PPOLossConfig(rollout_is_level="token")))
        data = {
            "input_ids": torch.tensor([[5, 6, 7, 8, 9], [0, 6, 7, 8, 0]]),
            "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]),
            "response_mask": torch.tensor([[1, 1], [1, 0]]),
            "advantages": torch.tensor([[1.0, 1.0], [-1.0, 0.0]]),
            "rollout_log_probs": torch.tensor([[-5.0, -5.5], [-4.0, 0.0]]),
        }
        if with_old:
            data["old_log_probs"] = data["rollout_log_probs"]
        engine.update(data)
        return dict(engine.export_weights())

    a, b = run(False), run(True)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ------------------------------------------------------------------ metrics, Ray
def test_metric_sums_reduce_by_name():
    m = MetricSums()
    m.add({"actor/pg_loss": 2.0, "rollout_is/max_ratio": 3.0, "x/min_len": 4.0}, 0.25)
    m.add({"actor/pg_loss": 4.0, "rollout_is/max_ratio": 1.0, "x/min_len": 2.0}, 0.75)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = m.reduce(None, torch.device("cpu"))
    assert out == {"actor/pg_loss": 3.5, "rollout_is/max_ratio": 3.0, "x/min_len": 2.0}
    assert not any(math.isinf(v) for v in out.values())


def test_ray_actor_factory_wraps_without_starting_ray():
    ray = pytest.importorskip("ray")
    cls = make_train_engine_actor("fsdp2", num_cpus=1)
    assert isinstance(cls, ray.actor.ActorClass)
    assert not ray.is_initialized()
    with pytest.raises(KeyError, match="fsdp2"):
        make_train_engine_actor("nope")


def test_the_topk_kl_weight_comes_from_the_recipes_config_not_from_a_key_core_reads():
    from offbeat.core.cli import load_recipe_config

    _, opd = load_recipe_config("opd", ["distillation.kl_coef=0.5"])
    _, k1 = load_recipe_config("opd", ["distillation.loss=reverse_kl"])
    _, plain = load_recipe_config("separate_async", [])
    assert ppo_loss_config(opd).topk_kl_coef == 0.5
    assert ppo_loss_config(k1).topk_kl_coef == 0.0
    assert ppo_loss_config(plain).topk_kl_coef == 0.0
    # core's loss reads no recipe section: OPD's config says its own weight
    import inspect
    import re

    import offbeat.core.train.loss as loss_module

    assert not re.search(r"\.distillation\b|[\"']distillation[\"']", inspect.getsource(loss_module))

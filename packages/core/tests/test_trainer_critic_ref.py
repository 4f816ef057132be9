"""The training loop with a critic and a reference model (fake engines, real buffer,
client, balancer and checkpoint engine): the step order (ref log-probs -> KL in the
reward -> values -> GAE -> actor updates -> critic updates), the metrics, and resume
restoring the critic, the reference and the KL controller."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from trainer_fakes import Harness

from offbeat.core.algorithms import gae_advantages, sequence_to_token_rewards
from offbeat.core.config import AlgorithmConfig, KLControlConfig
from offbeat.core.trainer import Critic, CriticAndReference, Reference

ROLLOUT_LP = -0.1  # FakeServer's log-prob of every token
REF_LP = -0.5


class FakeCriticEngine:
    """Values 0.1 × (updates so far) on every response token; records each update."""

    def __init__(self) -> None:
        self.updates = 0
        self.batches: list[dict] = []
        self.events: list[tuple[str, float]] = []

    def compute_values(self, batch):
        self.events.append(("values", time.perf_counter()))
        return 0.1 * self.updates * batch["response_mask"].float()

    def update(self, mini_batch):
        self.events.append(("update", time.perf_counter()))
        self.updates += 1
        self.batches.append(mini_batch)
        return {"critic/vf_loss": 1.0 / self.updates, "critic/lr": 1e-3}

    def save(self, path):
        Path(path).mkdir(parents=True)
        torch.save({"updates": self.updates}, Path(path) / "critic.pt")

    def load(self, path):
        self.updates = torch.load(Path(path) / "critic.pt")["updates"]


class FakeRefEngine:
    def __init__(self, shift: float = 0.0) -> None:
        self.w = torch.ones(3) + shift
        self.calls = 0

    def compute_log_probs(self, batch, temperature=None):
        self.calls += 1
        return REF_LP * batch["response_mask"].float()

    def export_weights(self):
        yield "w", self.w


def parts(estimator="gae", *, in_reward=True, ref_shift=0.0, lam=0.9) -> CriticAndReference:
    kl = AlgorithmConfig(use_kl_loss=True, use_kl_in_reward=in_reward, kl_penalty="k1",
                         kl_ctrl=KLControlConfig(type="adaptive", kl_coef=0.05, target_kl=0.1,
                                                 horizon=16))  # fmt: skip
    critic = Critic(FakeCriticEngine(), gamma=1.0, lam=lam) if estimator == "gae" else None
    reference = Reference(FakeRefEngine(ref_shift), kl)
    return CriticAndReference(critic=critic, reference=reference, adv_estimator=estimator)


def harness(tmp_path, cr, **kw) -> Harness:
    h = Harness(tmp_path, adv_estimator=cr.adv_estimator, **kw)
    h.trainer.critic_ref = cr
    return h


async def test_gae_step_order_batches_and_metrics(tmp_path):
    cr = parts()
    h = harness(tmp_path, cr)  # 3 steps x parameter_sync_step 2, one group of 2 per update
    await h.run()
    critic = cr.critic.engine
    assert critic.updates == 6 and h.engine.updates == 6
    # per step: values first, then (after the actor) the critic's 2 updates
    assert [e for e, _ in critic.events] == ["values", "update", "update"] * 3
    for mb in h.engine.batches:  # the actor saw the reference's log-probs and GAE's advantages
        mask = mb["response_mask"].bool()
        assert torch.equal(mb["ref_log_probs"][mask], torch.full((int(mask.sum()),), REF_LP))
        assert "returns" in mb and mb["advantages"][~mask].abs().sum() == 0
    assert critic.batches[0]["values"].abs().sum() == 0  # step 1: no critic update yet
    assert critic.batches[2]["values"].max() == pytest.approx(0.2)  # step 2: after 2
    rows = h.train_rows()
    assert len(rows) == 3
    for r in rows:
        assert r["actor/kl"] == pytest.approx(0.4)  # k1: -0.1 - (-0.5)
        for key in ("critic/vf_explained_var", "critic/vf_loss", "timing/values_s",
                    "timing/ref_log_prob_s", "timing/critic_update_s", "actor/kl_coef",
                    "actor/reward_kl_penalty"):  # fmt: skip
            assert key in r, key
    # KL 0.4 > target 0.1: the adaptive coefficient rises every step (4 rows per batch)
    coefs = [r["actor/kl_coef"] for r in rows]
    assert coefs[0] == pytest.approx(0.05) and coefs == sorted(coefs) and coefs[2] > coefs[1]
    assert cr.reference.controller.value == pytest.approx(0.05 * (1 + 0.2 * 4 / 16) ** 3)


async def test_gae_advantages_are_computed_from_the_penalised_rewards(tmp_path):
    cr = parts(lam=1.0)
    h = harness(tmp_path, cr, total_training_steps=1)
    await h.run()
    full = cr.critic.engine.batches  # the step's two mini-batches: the whole batch
    mask = torch.cat([b["response_mask"] for b in full])
    returns = torch.cat([b["returns"] for b in full])
    assert torch.cat([b["values"] for b in full]).abs().sum() == 0
    adv = torch.cat([b["advantages"] for b in full])
    assert torch.isfinite(adv).all() and adv[~mask.bool()].abs().sum() == 0
    # gamma = lam = 1, V = 0: the return at the first token is the sum of the token
    # rewards = score - beta x KL(k1 = 0.4) x length, with beta 0.05 at step 1
    scores = returns[:, 0] + 0.05 * 0.4 * mask.sum(-1)
    want = sequence_to_token_rewards(scores, mask)  # the score sits on the last token
    gae, _ = gae_advantages(want - 0.05 * 0.4 * mask, torch.zeros_like(mask), mask, whiten=False)
    torch.testing.assert_close(gae, returns, atol=1e-5, rtol=1e-5)
    assert scores.mean().item() == pytest.approx(h.train_rows()[0]["reward/mean"], abs=1e-5)


async def test_kl_in_reward_rewrites_grpo_advantages_without_a_critic(tmp_path):
    cr = parts("grpo")
    h = harness(tmp_path, cr, total_training_steps=1)
    await h.run()
    assert cr.critic is None and cr.rewrites_advantages
    mb = h.engine.batches[0]
    assert "values" not in mb and mb["ref_log_probs"].abs().sum() > 0


async def test_resume_restores_critic_reference_and_kl_controller(tmp_path):
    h1 = harness(tmp_path, parts(), total_training_steps=2, save_freq=1)
    await h1.run()
    step2 = h1.checkpoints.latest()
    assert (step2 / "critic").is_dir() and (step2 / "engine").is_dir()
    coef_after_2 = h1.trainer.critic_ref.reference.controller.value
    cr2 = parts()
    h2 = harness(tmp_path, cr2, total_training_steps=3, save_freq=1, resume=True)
    await h2.run()
    # the critic continued from its 4 updates, the controller from its 2 steps
    assert cr2.critic.engine.updates == 6
    assert cr2.critic.engine.batches[0]["values"].max() == pytest.approx(0.4)  # 0.1 x 4
    assert cr2.reference.controller.value == pytest.approx(coef_after_2 * (1 + 0.2 * 4 / 16))
    # a different reference model (model.path changed) refuses to resume
    (tmp_path / "other").mkdir()
    h3 = harness(tmp_path / "other", parts(ref_shift=1.0), total_training_steps=1)
    h3.trainer.checkpoints = h1.checkpoints
    h3.settings.trainer.resume = True
    with pytest.raises(ValueError, match="reference model's weights differ"):
        await h3.run()


async def test_resume_without_critic_state_fails_clearly(tmp_path):
    h1 = Harness(tmp_path, total_training_steps=1, save_freq=1)
    await h1.run()
    h2 = harness(tmp_path, parts(), total_training_steps=2, resume=True)
    with pytest.raises(FileNotFoundError, match="holds no critic state"):
        await h2.run()


async def test_gae_without_a_critic_fails_before_training(tmp_path):
    h = Harness(tmp_path, adv_estimator="gae")
    with pytest.raises(ValueError, match="needs a critic"):
        await h.run()
    assert h.engine.updates == 0

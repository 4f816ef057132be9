"""The KL penalty in the reward and its fixed / adaptive coefficient, and the reference
model's part of the step (`offbeat.core.trainer.reference`) on a fake engine."""

from __future__ import annotations

import pytest
import torch

from offbeat.core.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
)
from offbeat.core.config import AlgorithmConfig, KLControlConfig
from offbeat.core.trainer.reference import Reference, weights_fingerprint


def test_adaptive_controller_raises_beta_when_kl_is_above_target_and_lowers_it_below():
    up = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    up.update(current_kl=0.06, n_steps=10)  # 20% above target
    assert up.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    down = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    down.update(current_kl=0.04, n_steps=10)  # 20% below
    assert down.value == pytest.approx(0.1 * (1 - 0.2 * 10 / 100))
    on_target = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    on_target.update(current_kl=0.05, n_steps=10)
    assert on_target.value == pytest.approx(0.1)


def test_adaptive_controller_clips_the_error_and_converges_towards_the_target():
    far = AdaptiveKLController(1.0, target_kl=0.01, horizon=10)
    far.update(current_kl=5.0, n_steps=10)  # error 499 -> clipped to 0.2
    assert far.value == pytest.approx(1.2)
    far.update(current_kl=0.0, n_steps=10)  # error -1 -> clipped to -0.2
    assert far.value == pytest.approx(1.2 * 0.8)
    # a KL persistently above target keeps raising beta, monotonically
    c, seen = AdaptiveKLController(0.01, target_kl=0.1, horizon=64), []
    for _ in range(5):
        c.update(current_kl=0.3, n_steps=16)
        seen.append(c.value)
    assert seen == sorted(seen) and seen[0] > 0.01


def test_fixed_controller_never_moves_and_states_round_trip():
    f = build_kl_controller("fixed", 0.02)
    assert isinstance(f, FixedKLController)
    f.update(current_kl=10.0, n_steps=100)
    assert f.value == 0.02
    a = build_kl_controller("adaptive", 0.02, target_kl=0.1, horizon=10)
    a.update(0.5, 5)
    b = build_kl_controller("adaptive", 0.02, target_kl=0.1, horizon=10)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value != 0.02
    with pytest.raises(ValueError, match="must be one of"):
        build_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


def test_kl_penalty_is_subtracted_per_policy_token_only():
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # a gap in row 0
    scores = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, float("nan"), -2.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, 0.0, -2.5, 0.0], [-1.0, -3.0, 0.0, 0.0]])
    pen = apply_kl_penalty(scores, old, ref, mask, beta=0.1, kind="k1")
    # k1 = old - ref: 0.5, 0.5 in row 0; 0, 2 in row 1
    assert pen.kl.tolist() == [[0.5, 0.0, 0.5, 0.0], [0.0, 2.0, 0.0, 0.0]]
    want = torch.tensor([[-0.05, 0.0, 0.95, 0.0], [0.0, 1.8, 0.0, 0.0]])
    torch.testing.assert_close(pen.token_rewards, want)
    assert pen.current_kl == pytest.approx((0.5 + 1.0) / 2)  # mean of per-sequence means
    assert pen.beta == 0.1


class FakeRefEngine:
    def __init__(self, shift: float = 0.0) -> None:
        self.w = torch.arange(4.0) + shift

    def compute_log_probs(self, batch, temperature=None):
        return -0.5 * batch["response_mask"].float()

    def export_weights(self):
        yield "w", self.w


def batch(rows: int = 4) -> dict:
    mask = torch.ones(rows, 3)
    return {"response_mask": mask, "old_log_probs": -0.1 * mask}


def test_reference_in_reward_steps_its_controller_once_per_batch():
    s = AlgorithmConfig(use_kl_in_reward=True, kl_penalty="k1", kl_ctrl=KLControlConfig(
        type="adaptive", kl_coef=0.1, target_kl=0.2, horizon=8))  # fmt: skip
    ref = Reference(FakeRefEngine(), s)
    data = batch()
    data["ref_log_probs"] = ref.log_probs(data)
    scores = torch.zeros(4, 3)
    pen, metrics = ref.penalise(scores, data)
    assert pen.current_kl == pytest.approx(0.4)  # -0.1 - (-0.5), above target 0.2
    assert metrics["actor/kl_coef"] == 0.1  # the beta applied to this batch ...
    assert ref.controller.value == pytest.approx(0.1 * (1 + 0.2 * 4 / 8))  # ... then raised
    assert ref.kl_metrics(data)["actor/kl"] == pytest.approx(0.4)


def test_reference_state_restores_controller_and_refuses_other_weights():
    s = AlgorithmConfig(use_kl_in_reward=True, kl_ctrl=KLControlConfig(
        type="adaptive", kl_coef=0.1, target_kl=0.1, horizon=4))  # fmt: skip
    a = Reference(FakeRefEngine(), s)
    data = batch()
    data["ref_log_probs"] = a.log_probs(data)
    a.penalise(torch.zeros(4, 3), data)
    b = Reference(FakeRefEngine(), s)
    b.load_state(a.state())
    assert b.controller.value == a.controller.value != 0.1
    other = Reference(FakeRefEngine(shift=1.0), s)
    with pytest.raises(ValueError, match="reference model's weights differ"):
        other.load_state(a.state())
    assert weights_fingerprint(FakeRefEngine().export_weights()) == [4.0, 6.0, 14.0]

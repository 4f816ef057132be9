"""Every loss aggregation respects a response mask with gaps (multi-turn responses: tool
and template tokens between the policy's turns). A gapped row must give exactly the loss
and gradients of the same policy tokens laid out contiguously, whatever the gap positions
hold (NaN included), and no gradient may reach a gap."""

from __future__ import annotations

import pytest
import torch

from offbeat.core.algorithms import AGG_MODES, agg_loss, global_normalizer, rloo_advantages
from offbeat.core.algorithms.advantages import grpo_advantages
from offbeat.core.train.loss import PPOLoss, PPOLossConfig

# Two rows over 10 columns: policy tokens in runs, tool tokens between them, padding after.
GAPPED = torch.tensor(
    [[1, 1, 0, 0, 0, 1, 1, 1, 0, 0],
     [1, 0, 0, 1, 0, 0, 1, 1, 1, 0]]
)  # fmt: skip


def compact(values: torch.Tensor, mask: torch.Tensor, fill: float = 0.0):
    """The masked-in values of each row moved to its left, and the matching mask."""
    out = torch.full_like(values, fill)
    new_mask = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        kept = values[i][mask[i].bool()]
        out[i, : len(kept)] = kept
        new_mask[i, : len(kept)] = 1
    return out, new_mask


def with_garbage(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), values, torch.full_like(values, float("nan")))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_over_gaps_equals_the_contiguous_layout(mode):
    torch.manual_seed(0)
    loss = torch.randn(GAPPED.shape)
    gapped = agg_loss(
        with_garbage(loss, GAPPED), GAPPED, mode, global_normalizer(GAPPED, horizon=10)
    )
    c_loss, c_mask = compact(loss, GAPPED)
    contiguous = agg_loss(c_loss, c_mask, mode, global_normalizer(c_mask, horizon=10))
    assert torch.isfinite(gapped)
    torch.testing.assert_close(gapped, contiguous)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("is_level", ["none", "token", "sequence"])
def test_ppo_loss_over_gaps_equals_the_contiguous_layout(mode, is_level):
    torch.manual_seed(1)
    shape = GAPPED.shape
    rollout = -torch.rand(shape)
    old = rollout + 0.05 * torch.randn(shape)
    ref = rollout + 0.05 * torch.randn(shape)
    adv = torch.randn(shape[0], 1).expand(shape).clone()
    cur = rollout + 0.1 * torch.randn(shape)
    ent = torch.rand(shape)
    cfg = PPOLossConfig(
        loss_agg_mode=mode, rollout_is_level=is_level, use_kl_loss=True, entropy_coeff=0.01,
        horizon=10,
    )  # fmt: skip

    def run(mask, f):
        batch = {
            "response_mask": mask, "advantages": f(adv), "rollout_log_probs": f(rollout),
            "old_log_probs": f(old), "ref_log_probs": f(ref),
        }  # fmt: skip
        fn = PPOLoss(cfg)
        mb, _ = fn.prepare(batch)
        norm = global_normalizer(mb["loss_mask"], horizon=10)
        lp = f(cur).clone().requires_grad_(True)
        loss, metrics = fn(lp, f(ent), mb, norm)
        loss.backward()
        return loss, lp.grad, metrics

    g_loss, g_grad, g_metrics = run(GAPPED, lambda x: with_garbage(x, GAPPED))
    c_mask = compact(GAPPED, GAPPED)[1]
    c_loss, c_grad, c_metrics = run(c_mask, lambda x: compact(x, GAPPED)[0])
    torch.testing.assert_close(g_loss, c_loss)
    assert (g_grad[GAPPED == 0] == 0).all()  # nothing flows into tool tokens
    torch.testing.assert_close(compact(g_grad, GAPPED)[0], c_grad)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert g_metrics[key] == pytest.approx(c_metrics[key], rel=1e-5, abs=1e-7)


def test_outcome_advantages_are_zero_on_gaps():
    rewards = torch.tensor([1.0, 0.0])
    for adv in (
        grpo_advantages(rewards, GAPPED, ["g", "g"]),
        rloo_advantages(rewards, GAPPED, ["g", "g"]),
    ):
        assert (adv[GAPPED == 0] == 0).all()
        assert (adv[GAPPED == 1] != 0).all()

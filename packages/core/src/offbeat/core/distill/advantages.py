"""The on-policy distillation signal: per-token advantages from teacher log-probs.

Knows only tensors: the student's log-probs of its own sampled tokens (the behaviour
policy's, as the rollout returned them), the teacher's log-probs of the same tokens, the
response mask, and optionally the task reward's GRPO advantage to mix in. No discount
and no group baseline: each token's advantage is its own negative reverse-KL sample
(verl's k1 estimate, the published OPD recipe). The policy-gradient loss, its clipping,
rollout correction and aggregation are the trainer's, unchanged.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from offbeat.core.algorithms.advantages import grpo_advantages

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "TEACHER_ID",
    "TEACHER_LOG_PROBS",
    "TEACHER_TOP_IDS",
    "TEACHER_TOP_LOG_PROBS",
    "opd_advantages",
    "reverse_kl_by_teacher",
]

# "k1": the published recipe. "k1_centred": k1 minus its token mean over the batch (a
# constant baseline: the same expected gradient, much less variance far from the teacher).
ADVANTAGES = ("k1", "k1_centred")

# Trajectory extras the distillation agent loop writes and the trainer hook reads.
TEACHER_LOG_PROBS = "teacher_log_probs"
TEACHER_ID = "teacher_id"
# With distillation.loss=topk_forward_kl: per response token, the teacher's k most likely
# next tokens and their log-probs ([B, R, k] once padded; the ids as floats, exact below
# 2^24).
TEACHER_TOP_IDS = "teacher_top_ids"
TEACHER_TOP_LOG_PROBS = "teacher_top_log_probs"
# The loss: "reverse_kl" (the k1 policy-gradient advantage above) or "topk_forward_kl"
# (forward KL to the teacher's renormalised top-k at each sampled prefix, added to the
# policy loss by the train engine; the advantage is then the reward mix only).
LOSSES = ("reverse_kl", "topk_forward_kl")


def opd_advantages(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float = 1.0,
    rewards: torch.Tensor | None = None,
    group_uids: Sequence[Hashable] | None = None,
    reward_weight: float = 0.0,
    norm_by_std: bool = True,
    mode: str = "k1",
) -> torch.Tensor:
    """[B, R] advantages: `-kl_coef * (log pi_s - log pi_t)` on each response token
    (`mode="k1_centred"`: minus its mean over the batch's response tokens), plus
    `reward_weight` x the GRPO advantage of `rewards` when that weight is > 0; zero on
    padding."""
    if mode not in ADVANTAGES:
        raise ValueError(f"mode={mode!r}: expected one of {ADVANTAGES}")
    if not student_log_probs.shape == teacher_log_probs.shape == response_mask.shape:
        raise ValueError(
            f"shapes differ: student {tuple(student_log_probs.shape)}, teacher "
            f"{tuple(teacher_log_probs.shape)}, mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.to(torch.float32)
    adv = -kl_coef * (student_log_probs.float() - teacher_log_probs.float()) * mask
    if mode == "k1_centred" and mask.sum() > 0:
        adv = (adv - adv.sum() / mask.sum()) * mask
    if reward_weight > 0:
        if rewards is None or group_uids is None:
            raise ValueError("reward_weight > 0 needs rewards and group_uids")
        adv = adv + reward_weight * grpo_advantages(
            rewards, response_mask, group_uids, norm_by_std=norm_by_std
        )
    return adv


def reverse_kl_by_teacher(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    teacher_ids: torch.Tensor,
    names: Sequence[str],
) -> dict[str, float]:
    """Per teacher: the token-mean k1 estimate of KL(student || teacher) over its rows
    (`distill/<name>/reverse_kl`) and its token count (`distill/<name>/tokens`)."""
    out: dict[str, float] = {}
    mask = response_mask.to(torch.float32)
    diff = (student_log_probs.float() - teacher_log_probs.float()) * mask
    for i, name in enumerate(names):
        rows = teacher_ids.round().long() == i
        tokens = float(mask[rows].sum())
        if tokens == 0:
            continue
        out[f"distill/{name}/reverse_kl"] = float(diff[rows].sum()) / tokens
        out[f"distill/{name}/tokens"] = tokens
    return out

"""Advantage estimators: GRPO (with or without std normalisation), RLOO, and GAE.

Inputs are tensors and group ids only; the estimators know nothing about batches,
models or the critic that produced `values`. Outputs are [B, T] per-token advantages
(and returns), zero on masked tokens. Each estimator is registered in `ADV_ESTIMATORS`
under its config name behind the uniform signature of `compute_advantages`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from offbeat.core.algorithms.aggregation import zero_masked
from offbeat.core.registry import ADV_ESTIMATORS

__all__ = [
    "compute_advantages",
    "gae_advantages",
    "grpo_advantages",
    "masked_whiten",
    "rloo_advantages",
    "sequence_to_token_rewards",
]


def _groups(group_uids: Sequence[Hashable], n: int) -> list[list[int]]:
    if len(group_uids) != n:
        raise ValueError(f"{len(group_uids)} group ids for {n} rewards")
    rows: dict[Hashable, list[int]] = defaultdict(list)
    for i, uid in enumerate(group_uids):
        rows[uid].append(i)
    return list(rows.values())


def grpo_advantages(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_uids: Sequence[Hashable],
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """(r - group mean) [/ (group std + eps)], broadcast over each response's tokens.

    A group of one has no baseline: its advantage is 0 (it carries no learning signal).
    The std is the unbiased one; `norm_by_std=False` gives Dr. GRPO's unscaled form.
    """
    scores = torch.zeros_like(rewards, dtype=torch.float32)
    r = rewards.to(torch.float32)
    for rows in _groups(group_uids, r.shape[0]):
        if len(rows) < 2:
            continue
        idx = torch.tensor(rows)
        centred = r[idx] - r[idx].mean()
        scores[idx] = centred / (r[idx].std() + eps) if norm_by_std else centred
    return scores[:, None] * response_mask.to(torch.float32)


def rloo_advantages(
    rewards: torch.Tensor, response_mask: torch.Tensor, group_uids: Sequence[Hashable]
) -> torch.Tensor:
    """r_i - mean of the OTHER rewards of its group (leave-one-out); 0 for a group of one."""
    scores = torch.zeros_like(rewards, dtype=torch.float32)
    r = rewards.to(torch.float32)
    for rows in _groups(group_uids, r.shape[0]):
        k = len(rows)
        if k < 2:
            continue
        idx = torch.tensor(rows)
        scores[idx] = r[idx] - (r[idx].sum() - r[idx]) / (k - 1)
    return scores[:, None] * response_mask.to(torch.float32)


def sequence_to_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] sequence rewards placed on each response's last real token ([B, T])."""
    mask = response_mask.to(torch.float32)
    out = torch.zeros_like(mask)
    lengths = mask.sum(-1).long()
    has = lengths > 0
    rows = torch.arange(mask.shape[0])[has]
    out[rows, lengths[has] - 1] = rewards.to(torch.float32)[has]
    return out


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the masked entries; masked-out entries become 0 (whatever
    they held, NaN included)."""
    m = mask.to(values.dtype)
    values = zero_masked(values, m)
    count = m.sum().clamp(min=1.0)
    mean = values.sum() / count
    var = zero_masked((values - mean) ** 2, m).sum() / (count - 1).clamp(min=1.0)
    return zero_masked((values - mean) * torch.rsqrt(var + eps), m)


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over right-padded responses.

    delta_t = r_t + gamma V_{t+1} - V_t with V = 0 past each response's end;
    A_t = delta_t + gamma lam A_{t+1}. Returns (advantages, returns = A + V), both [B, T];
    advantages are whitened over the mask unless `whiten=False`.
    """
    mask = response_mask.to(torch.float32)
    rewards = zero_masked(token_rewards.to(torch.float32), mask)
    values = zero_masked(values.detach().to(torch.float32), mask)
    t_len = mask.shape[1]
    adv = torch.zeros_like(mask)
    last = torch.zeros(mask.shape[0])
    for t in reversed(range(t_len)):
        nxt_mask = mask[:, t + 1] if t + 1 < t_len else torch.zeros(mask.shape[0])
        nxt_value = values[:, t + 1] * nxt_mask if t + 1 < t_len else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * nxt_value - values[:, t]
        last = delta + gamma * lam * nxt_mask * last
        adv[:, t] = last
    adv = adv * mask
    returns = (adv + values) * mask
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns


def compute_advantages(
    name: str,
    *,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_uids: Sequence[Hashable],
    values: torch.Tensor | None = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) from the estimator registered as `name`.

    `options` may carry every algorithm option (`norm_by_std`, `gamma`, `lam`, ...); each
    estimator takes what it uses. For the outcome estimators returns == advantages.
    """
    fn = ADV_ESTIMATORS.get(name)
    return fn(rewards, response_mask, group_uids, values=values, **options)


@ADV_ESTIMATORS.register("grpo")
def _grpo(rewards, response_mask, group_uids, *, values=None, norm_by_std=True, **_):
    adv = grpo_advantages(rewards, response_mask, group_uids, norm_by_std=norm_by_std)
    return adv, adv


@ADV_ESTIMATORS.register("rloo")
def _rloo(rewards, response_mask, group_uids, *, values=None, **_):
    adv = rloo_advantages(rewards, response_mask, group_uids)
    return adv, adv


@ADV_ESTIMATORS.register("gae")
def _gae(rewards, response_mask, group_uids, *, values=None, gamma=1.0, lam=1.0, whiten=True, **_):
    if values is None:
        raise ValueError("advantage estimator 'gae' needs the critic's values")
    token_rewards = sequence_to_token_rewards(rewards, response_mask)
    return gae_advantages(token_rewards, values, response_mask, gamma=gamma, lam=lam, whiten=whiten)


_gae.needs_critic = True  # type: ignore[attr-defined]  # read by config validation

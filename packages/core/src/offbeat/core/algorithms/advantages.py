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
    "explained_variance",
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
    """[B] sequence rewards placed on each response's last real token ([B, T]): the last
    position whose mask is 1, so a mask with gaps (tool or observation tokens masked out
    inside a multi-turn response) puts it on the last policy token."""
    mask = response_mask.to(torch.float32)
    out = torch.zeros_like(mask)
    has = mask.sum(-1) > 0
    positions = torch.arange(mask.shape[1], dtype=torch.float32)
    last = torch.where(mask > 0, positions, -1.0).max(-1).values.long()
    rows = torch.arange(mask.shape[0])[has]
    out[rows, last[has]] = rewards.to(torch.float32)[has]
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
    """Generalised advantage estimation over responses whose mask may have gaps.

    delta_t = r_t + gamma V_next - V_t; A_t = delta_t + gamma lam A_next, where "next" is
    the next position whose mask is 1 (V_next = A_next = 0 past the last one). Masked
    positions inside a response (tool or observation tokens of a multi-turn trajectory)
    are skipped: the value and the advantage are carried through them unchanged, as verl
    does, instead of being reset, so A_t of the turn before a tool call sees the rewards
    and values after it. Right padding is the gap at the end. Returns (advantages,
    returns = A + V), both [B, T] and 0 on masked positions; advantages are whitened over
    the mask unless `whiten=False`.
    """
    mask = response_mask.to(torch.float32)
    rewards = zero_masked(token_rewards.to(torch.float32), mask)
    values = zero_masked(values.detach().to(torch.float32), mask)
    adv = torch.zeros_like(mask)
    next_value = torch.zeros(mask.shape[0])
    next_adv = torch.zeros(mask.shape[0])
    for t in reversed(range(mask.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        # A masked position passes the next real position's value and advantage on.
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, a, next_adv)
        adv[:, t] = a
    adv = zero_masked(adv, mask)
    returns = zero_masked(adv + values, mask)
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked tokens: 1 is a perfect
    critic, 0 one no better than the mean return, negative one worse (nan when the returns
    do not vary)."""
    m = mask.bool()
    ret, val = returns[m].double(), values[m].double()
    if ret.numel() < 2:
        return float("nan")
    var = ret.var()
    if var <= 0:
        return float("nan")
    return float(1.0 - (ret - val).var() / var)


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
def _gae(
    rewards, response_mask, group_uids, *, values=None, gamma=1.0, lam=1.0, whiten=True,
    token_rewards=None, **_,
):  # fmt: skip
    if values is None:
        raise ValueError("advantage estimator 'gae' needs the critic's values")
    if token_rewards is None:  # else: per-token rewards given (e.g. a KL penalty in them)
        token_rewards = sequence_to_token_rewards(rewards, response_mask)
    return gae_advantages(token_rewards, values, response_mask, gamma=gamma, lam=lam, whiten=whiten)


_gae.needs_critic = True  # type: ignore[attr-defined]  # read by config validation

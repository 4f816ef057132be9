"""Token log-probs and entropy from vocabulary-parallel logits (each TP rank holds a slice
of the vocabulary), at a temperature, with their exact gradient.

Knows nothing about models or Megatron: [N, V/tp] logits in, [N] float32 log-probs (and
entropy) out. The forward reduces three numbers per row over the TP group (max, sum of
exponentials, the target's logit; a fourth, the expected logit, for the entropy); the
backward needs no communication, because each rank's slice of dL/dlogits depends only on
its own logits and those row statistics. Rows of padded vocabulary (beyond `vocab_size`)
never count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_log_probs"]


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


# Rows per pass: bounds the float32 temporaries to rows x (V / tp) x 4 bytes each.
CHUNK_ROWS = 2048


def _stats(logits, targets, temperature, start, valid, group, with_entropy):
    """(log-sum-exp, target log-prob, entropy or None) of one chunk of rows, float32."""
    z = logits[:, :valid].float() / temperature
    m = z.max(dim=-1).values
    _all_reduce(m, dist.ReduceOp.MAX, group)
    e = torch.exp(z - m.unsqueeze(-1))
    s = e.sum(dim=-1)
    _all_reduce(s, dist.ReduceOp.SUM, group)
    lse = m + torch.log(s)
    local = targets - start
    mine = (local >= 0) & (local < valid)
    idx = local.clamp(0, valid - 1)
    zt = torch.where(mine, z.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros_like(m))
    _all_reduce(zt, dist.ReduceOp.SUM, group)
    entropy = None
    if with_entropy:
        ez = (e * z).sum(dim=-1)  # sum_v exp(z - m) z over this slice
        _all_reduce(ez, dist.ReduceOp.SUM, group)
        entropy = lse - ez / s
    return lse, zt - lse, entropy


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, start, valid, group, with_entropy):
        lse, log_prob, entropy = [], [], []
        for i in range(0, logits.shape[0], CHUNK_ROWS):
            rows = slice(i, i + CHUNK_ROWS)
            a, b, c = _stats(
                logits[rows], targets[rows], temperature, start, valid, group, with_entropy
            )
            lse.append(a)
            log_prob.append(b)
            entropy.append(c if with_entropy else a)
        lse_t, lp_t, ent_t = torch.cat(lse), torch.cat(log_prob), torch.cat(entropy)
        ctx.save_for_backward(logits, targets, lse_t, ent_t)
        ctx.temperature, ctx.start, ctx.valid, ctx.with_entropy = (
            temperature,
            start,
            valid,
            with_entropy,
        )
        return lp_t, (ent_t if with_entropy else torch.zeros_like(lp_t))

    @staticmethod
    def backward(ctx, g_log_prob, g_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        t, start, valid = ctx.temperature, ctx.start, ctx.valid
        use_entropy = ctx.with_entropy and g_entropy is not None
        grad = torch.zeros_like(logits)
        for i in range(0, logits.shape[0], CHUNK_ROWS):
            rows = slice(i, i + CHUNK_ROWS)
            z = logits[rows, :valid].float() / t
            log_p = z - lse[rows].unsqueeze(-1)
            p = torch.exp(log_p)
            local = targets[rows] - start
            mine = (local >= 0) & (local < valid)
            onehot = torch.zeros_like(z)
            onehot.scatter_(
                -1, local.clamp(0, valid - 1).unsqueeze(-1), mine.to(z.dtype).unsqueeze(-1)
            )
            gz = g_log_prob[rows].float().unsqueeze(-1) * (onehot - p)
            if use_entropy:
                h = entropy[rows].unsqueeze(-1)
                gz = gz - g_entropy[rows].float().unsqueeze(-1) * p * (log_p + h)
            grad[rows, :valid] = (gz / t).to(logits.dtype)
        return grad, None, None, None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[targets] and, with `with_entropy`, the entropy of that
    distribution, per row, in float32. `logits` [N, V/tp] is this TP rank's vocabulary
    slice (rank r holds rows r*V/tp ...); `vocab_size` is the real vocabulary (the padded
    tail is ignored)."""
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    width = logits.shape[-1]
    start = rank * width
    valid = max(0, min(width, vocab_size - start))
    if valid == 0:
        raise ValueError(f"TP rank {rank} holds only vocabulary padding: shrink the TP size")
    log_prob, entropy = _LogProbs.apply(
        logits, targets, float(temperature), start, valid, group, with_entropy
    )
    return log_prob, (entropy if with_entropy else None)

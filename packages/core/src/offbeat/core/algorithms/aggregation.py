"""Loss aggregation over a mini-batch, normalised GLOBALLY.

A mini-batch is cut into micro-batches (gradient accumulation) and shards (data-parallel
ranks). Normalising each micro-batch by its own token or sequence count makes the summed
gradient depend on how the batch was cut; other systems shipped exactly that bug. Here
the normaliser (`LossNormalizer`: token count, sequence count, horizon) is computed ONCE
for the whole mini-batch, across all micro-batches and ranks, and every micro-batch loss
divides by it, so the sum of micro-batch losses (and gradients) over all micro-batches on
all ranks equals the full mini-batch's.

Masked tokens never reach the sum: padding may hold NaN or inf (a log-prob of -inf, an
unwritten buffer), and `x * mask` would turn those into NaN. Every aggregation and
`masked_mean` selects with `torch.where` on the mask instead (`zero_masked`).

Knows nothing about models or optimizers; only [B, T] per-token losses and masks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from offbeat.core.registry import LOSS_AGG_MODES

__all__ = [
    "AGG_MODES",
    "LossNormalizer",
    "agg_loss",
    "global_normalizer",
    "masked_mean",
    "zero_masked",
]

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)


@dataclass(frozen=True)
class LossNormalizer:
    """The denominators of one mini-batch, counted over every micro-batch and rank.

    `num_tokens`: tokens with mask 1. `num_seqs`: sequences with at least one such token
    (fully masked rows do not dilute the mean). `horizon`: the constant response length
    `seq-mean-token-sum-norm` divides by (use the config's max response tokens; it must not
    be a micro-batch's padded width). `loss_scale` multiplies every loss: set it to the
    data-parallel world size when the DP wrapper AVERAGES gradients over ranks (FSDP and
    DDP do), so that the averaged gradient is still the mini-batch gradient.
    """

    num_tokens: float
    num_seqs: float
    horizon: float = 1.0
    loss_scale: float = 1.0

    @classmethod
    def from_mask(cls, mask: torch.Tensor, *, horizon: float | None = None) -> LossNormalizer:
        """Local counts of one [B, T] mask; horizon defaults to its longest row."""
        lengths = mask.detach().to(torch.float64).sum(-1)
        longest = float(lengths.max()) if lengths.numel() else 0.0
        return cls(
            num_tokens=float(lengths.sum()),
            num_seqs=float((lengths > 0).sum()),
            horizon=float(horizon) if horizon is not None else longest,
        )

    @classmethod
    def combine(cls, parts: Iterable[LossNormalizer]) -> LossNormalizer:
        """Counts of several disjoint parts (micro-batches or ranks): sums, max horizon."""
        parts = list(parts)
        if not parts:
            raise ValueError("LossNormalizer.combine: no parts")
        return cls(
            num_tokens=sum(p.num_tokens for p in parts),
            num_seqs=sum(p.num_seqs for p in parts),
            horizon=max(p.horizon for p in parts),
            loss_scale=parts[0].loss_scale,
        )


def global_normalizer(
    masks: torch.Tensor | Iterable[torch.Tensor],
    *,
    horizon: float | None = None,
    group: dist.ProcessGroup | None = None,
    loss_scale: float = 1.0,
) -> LossNormalizer:
    """The normaliser of a mini-batch from this rank's masks (one [B, T] mask, or one per
    micro-batch), summed over the ranks of `group` when torch.distributed is initialised.

    Call it once per mini-batch, before the first micro-batch, with the FINAL loss masks
    (after any masked importance sampling has removed tokens or sequences).
    """
    masks = [masks] if isinstance(masks, torch.Tensor) else list(masks)
    local = LossNormalizer.combine(LossNormalizer.from_mask(m, horizon=horizon) for m in masks)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        counts = torch.tensor([local.num_tokens, local.num_seqs], dtype=torch.float64)
        longest = torch.tensor([local.horizon], dtype=torch.float64)
        backend = dist.get_backend(group)
        if backend == "nccl":
            counts, longest = counts.cuda(), longest.cuda()
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
        local = LossNormalizer(float(counts[0]), float(counts[1]), float(longest[0]))
    return LossNormalizer(local.num_tokens, local.num_seqs, local.horizon, loss_scale)


def agg_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: LossNormalizer
) -> torch.Tensor:
    """Aggregate a [B, T] per-token loss of ONE micro-batch into its share of the
    mini-batch loss, with the mini-batch's global `normalizer`. `mode` is a name in
    `LOSS_AGG_MODES` (the five built-ins are `AGG_MODES`)."""
    fn: Callable[[torch.Tensor, torch.Tensor, LossNormalizer], torch.Tensor]
    fn = LOSS_AGG_MODES.get(mode)
    if loss_mat.shape != mask.shape:
        raise ValueError(f"agg_loss: loss {tuple(loss_mat.shape)} vs mask {tuple(mask.shape)}")
    loss_mat = zero_masked(loss_mat, mask)
    return fn(loss_mat, mask.to(loss_mat.dtype), normalizer) * normalizer.loss_scale


def zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` where `mask` is nonzero, exactly 0 elsewhere, whatever (NaN, inf) was there.

    Unlike `values * mask` it neither lets NaN through nor sends NaN gradients back into
    the masked positions (their gradient is exactly 0)."""
    return torch.where(mask.bool(), values, values.new_zeros(()))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is 1 (0 when the mask is empty); for metrics.
    Non-finite values on masked positions are ignored."""
    weight = mask.to(values.dtype)
    return zero_masked(values, mask).mul(weight).sum() / weight.sum().clamp(min=1.0)


def _safe(x: float) -> float:
    return x if x > 0 else 1.0


@LOSS_AGG_MODES.register("token-mean")
def _token_mean(loss: torch.Tensor, mask: torch.Tensor, n: LossNormalizer) -> torch.Tensor:
    return (loss * mask).sum() / _safe(n.num_tokens)


@LOSS_AGG_MODES.register("token-sum")
def _token_sum(loss: torch.Tensor, mask: torch.Tensor, n: LossNormalizer) -> torch.Tensor:
    return (loss * mask).sum()


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, n: LossNormalizer) -> torch.Tensor:
    return (loss * mask).sum(-1).sum() / _safe(n.num_seqs)


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, n: LossNormalizer
) -> torch.Tensor:
    # Dr. GRPO: every sequence's token sum over one constant horizon, then the mean.
    return (loss * mask).sum(-1).sum() / (_safe(n.num_seqs) * _safe(n.horizon))


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, n: LossNormalizer) -> torch.Tensor:
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / _safe(n.num_seqs)

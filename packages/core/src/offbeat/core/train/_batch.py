"""Tensor-batch plumbing shared by train engines: reading the padded batch, cutting it into
micro-batches, and turning logits into per-token log-probs and entropy.

Knows nothing about models or sharding; the layout it assumes (responses in the last R
columns of input_ids) is the one documented in `offbeat.core.train.engine`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from offbeat.core.train.engine import batch_field


def as_tensor_dict(batch: Any, device: torch.device | None = None) -> dict[str, Any]:
    """A shallow dict view of a mapping or an object's public attributes, tensors moved to
    `device`; the required fields are checked so a bad batch fails before any forward."""
    if isinstance(batch, Mapping):
        items = dict(batch)
    elif callable(getattr(batch, "model_inputs", None)):  # offbeat.core.data.TrajectoryBatch
        items = dict(batch.model_inputs())
    elif hasattr(batch, "__dict__"):
        items = {k: v for k, v in vars(batch).items() if not k.startswith("_")}
    else:
        raise TypeError(
            f"train batch must be a mapping or an object with fields, got {type(batch)}"
        )
    for name in ("input_ids", "attention_mask", "response_mask"):
        batch_field(items, name)
    input_ids, response_mask = items["input_ids"], items["response_mask"]
    if input_ids.dim() != 2 or response_mask.dim() != 2:
        raise ValueError(
            f"train batch: input_ids {tuple(input_ids.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be 2-D [B, S] and [B, R]"
        )
    if response_mask.shape[0] != input_ids.shape[0] or response_mask.shape[1] >= input_ids.shape[1]:
        raise ValueError(
            f"train batch: response_mask {tuple(response_mask.shape)} must have input_ids' "
            f"rows {input_ids.shape[0]} and fewer columns than its {input_ids.shape[1]} "
            "(responses are the last R columns, after at least one prompt token)"
        )
    if input_ids.shape[0] == 0:
        raise ValueError("train batch has no rows: every rank needs at least one sequence")
    if device is not None:
        items = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in items.items()}
    return items


def num_rows(batch: dict[str, Any]) -> int:
    return int(batch["input_ids"].shape[0])


def split_rows(batch: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """Consecutive micro-batches of at most `size` rows; tensors whose first dimension is
    the batch are sliced, and so are per-row lists (`multi_modal`); everything else is
    shared."""
    rows = num_rows(batch)
    out = []
    for start in range(0, rows, size):
        part = {}
        for k, v in batch.items():
            if (isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows) or (
                k == "multi_modal" and isinstance(v, list) and len(v) == rows
            ):
                part[k] = v[start : start + size]
            else:
                part[k] = v
        out.append(part)
    return out


def position_ids_of(batch: dict[str, Any]) -> torch.Tensor:
    """Given position_ids, or the running count of real tokens (0 for left padding)."""
    given = batch.get("position_ids")
    if given is not None:
        return given
    mask = batch["attention_mask"].long()
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets], in float32 (or wider) whatever the logits' dtype."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)

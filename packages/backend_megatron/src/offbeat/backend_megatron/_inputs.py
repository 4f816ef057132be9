"""What the Megatron model sees of a padded batch: each row's real tokens packed to the left
(causal attention then needs no mask, and RoPE positions are the running count of real
tokens, as HF computes them for this layout), and pad-token lookups that train nothing.

Knows nothing about losses or parallelism; the batch layout is the one documented in
`offbeat.core.train.engine`.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["freeze_padding_row", "packed"]


def packed(mb: dict[str, Any], multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids with each row's real tokens moved to the front, cut to the longest row
    (rounded up to `multiple`); the packed column of the logit that predicts each response
    column; the response targets)."""
    ids, mask = mb["input_ids"], mb["attention_mask"].long()
    width = mb["response_mask"].shape[1]
    order = torch.argsort(1 - mask, dim=1, stable=True)  # real tokens first, in order
    length = int(mask.sum(dim=1).max())
    length = -(-length // multiple) * multiple
    packed = ids.gather(1, order)[:, :length]
    if packed.shape[1] < length:
        packed = torch.nn.functional.pad(packed, (0, length - packed.shape[1]))
    column = mask.cumsum(dim=1)[:, -width:] - 1  # packed column of each response token
    return packed, (column - 1).clamp(min=0), ids[:, -width:]


def freeze_padding_row(model: torch.nn.Module, hf: Any) -> None:
    """HF builds its input embedding with ``padding_idx = pad_token_id``: a lookup of that
    token passes no gradient to its row (a tied LM head still does). Do the same, so both
    engines train the same parameters: the lookup's output at pad tokens is detached."""
    pad = getattr(hf, "pad_token_id", None)
    embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if pad is None or embedding is None:
        return

    def detach_pad(module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
        is_pad = (args[0] == pad).unsqueeze(-1)
        return (
            torch.where(is_pad, output.detach(), output)
            if is_pad.shape[:2] == output.shape[:2]
            else output
        )

    embedding.register_forward_hook(detach_pad)

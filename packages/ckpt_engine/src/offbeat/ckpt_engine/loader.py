"""A ready-made `load_weights` for a model whose weights are plain tensors by name: every
received tensor is copied into the tensor of the same name with fused multi-tensor copies
(one host call per bucket instead of one `copy_` per tensor); on a GPU, the copies of a
bucket that comes again with the same tensors (every step, once the sender's storages are
read in place) are replayed as one CUDA graph (see `_graphs`).

Use it as the model's loader, or from the model's own `load_weights` for the plain part of
it. Knows nothing about name mapping, fused (q/k/v) or sharded parameters: a model that
needs those keeps its own loader.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from offbeat.ckpt_engine._graphs import GraphedCopies
from offbeat.ckpt_engine.bucket import copy_many
from offbeat.ckpt_engine.target import LoadWeightsFn

__all__ = ["copy_into"]


def copy_into(params: Mapping[str, torch.Tensor], *, graphs: bool = True) -> LoadWeightsFn:
    """A `load_weights` that copies each (name, tensor) into `params[name]`.

    Copies are queued on the current stream and not waited for, as `receive` expects.
    Raises KeyError for a name that `params` lacks and ValueError for a shape or dtype that
    differs from the parameter's; nothing of that call is copied then. `graphs`: on CUDA,
    replay the copies of a call whose tensors (addresses and sizes) were seen before as a
    CUDA graph (captured on the second sight).
    """
    graphed = GraphedCopies() if graphs else None

    def load_weights(pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for name, t in pairs:
            p = params.get(name)
            if p is None:
                raise KeyError(
                    f"load_weights: no weight named {name!r} in the model ({len(params)} weights)"
                )
            if p.shape != t.shape or p.dtype != t.dtype:
                raise ValueError(
                    f"load_weights: {name!r} is {t.dtype} {tuple(t.shape)}, "
                    f"the model's is {p.dtype} {tuple(p.shape)}"
                )
            dsts.append(p.data if p.requires_grad else p)
            srcs.append(t)
        if dsts and not (graphed is not None and graphed(dsts, srcs)):
            copy_many(dsts, srcs)

    return load_weights

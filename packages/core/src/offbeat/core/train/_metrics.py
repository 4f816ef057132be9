"""Reducing one update's metrics over micro-batches and data-parallel ranks.

Knows nothing about what the metrics mean beyond their names: a name that
`offbeat.core.metrics.reduction_for` reduces by max or min (``rollout_is/max_ratio``) is
reduced as such, every other value is a mean whose parts come pre-weighted (by their
share of the mini-batch's loss tokens).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist

from offbeat.core.metrics import reduction_for


def _kind(name: str) -> str:
    how = reduction_for(name)
    return how if how in ("max", "min") else "mean"


class MetricSums:
    """Weighted sums (means), running maxima and minima of named scalars."""

    def __init__(self) -> None:
        self._values: dict[str, float] = {}

    def add(self, metrics: Mapping[str, float], weight: float) -> None:
        for name, value in metrics.items():
            value = float(value)
            kind = _kind(name)
            if kind == "mean":
                self._values[name] = self._values.get(name, 0.0) + weight * value
            elif name not in self._values:
                self._values[name] = value
            else:
                pick = max if kind == "max" else min
                self._values[name] = pick(self._values[name], value)

    def reduce(self, group: dist.ProcessGroup | None, device: torch.device) -> dict[str, float]:
        """The values over all ranks of `group` (collective; the same dict on every rank)."""
        names = set(self._values)
        if dist.get_world_size(group) > 1:
            gathered: list[list[str] | None] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, sorted(names), group=group)
            names = {n for part in gathered for n in (part or [])}
        order = sorted(names)
        neutral = {"mean": 0.0, "max": -math.inf, "min": math.inf}
        out: dict[str, float] = {}
        for kind, op in (
            ("mean", dist.ReduceOp.SUM),
            ("max", dist.ReduceOp.MAX),
            ("min", dist.ReduceOp.MIN),
        ):
            keys = [n for n in order if _kind(n) == kind]
            if not keys:
                continue
            t = torch.tensor(
                [self._values.get(k, neutral[kind]) for k in keys],
                dtype=torch.float64,
                device=device,
            )
            if dist.get_world_size(group) > 1:
                dist.all_reduce(t, op=op, group=group)
            out.update(zip(keys, t.cpu().tolist(), strict=True))
        return out

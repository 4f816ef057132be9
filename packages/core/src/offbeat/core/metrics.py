"""Merging the metrics of the several mini-batch updates inside one global step.

One global step runs `parameter_sync_step` mini-batch updates, each reporting a flat
`{name: number}` dict; the step logs one dict. How a metric merges follows from its NAME
(the last "/"-separated segment is the *leaf*), checked in this order:

1. **last** value: leaf is `lr`, `learning_rate`, `step`, `global_step` or `epoch`, or
   ends with `_lr` (e.g. `actor/lr`, `critic/critic_lr`).
2. **mean** for rates: the leaf contains `per_` (e.g. `perf/tokens_per_s`).
3. **max**: the leaf is `max`, starts with `max_` or ends with `_max`
   (e.g. `rollout_is/max_ratio`, `response_length/max`).
4. **min**: likewise with `min`.
5. **sum** for timings: the name starts with `timing/` or `time/`, or the leaf ends with
   `_time`, `_sec` or `_s` (e.g. `timing/update_actor`, `actor/backward_s`).
6. **sum** for counts: the leaf starts with `num_` or `n_`, or ends with `count`,
   `_tokens` or `_samples` (e.g. `actor/num_tokens`, `buffer/dropped_count`).
7. otherwise a **sample-weighted mean**: each update's value weighs by the `weight`
   (e.g. samples or tokens) it was added with; updates that did not report the metric
   do not count.

Knows nothing about loggers or what the metrics mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["MetricsAggregator", "Reduction", "reduction_for"]

Reduction = Literal["last", "sum", "max", "min", "mean"]

_LAST_LEAVES = frozenset({"lr", "learning_rate", "step", "global_step", "epoch"})


def reduction_for(name: str) -> Reduction:
    """How the metric `name` merges across updates (the rules in the module docstring)."""
    leaf = name.rsplit("/", 1)[-1]
    if leaf in _LAST_LEAVES or leaf.endswith("_lr"):
        return "last"
    if "per_" in leaf:
        return "mean"
    if leaf == "max" or leaf.startswith("max_") or leaf.endswith("_max"):
        return "max"
    if leaf == "min" or leaf.startswith("min_") or leaf.endswith("_min"):
        return "min"
    if name.startswith(("timing/", "time/")) or leaf.endswith(("_time", "_sec", "_s")):
        return "sum"
    if leaf.startswith(("num_", "n_")) or leaf.endswith(("count", "_tokens", "_samples")):
        return "sum"
    return "mean"


class MetricsAggregator:
    """Accumulates per-update metric dicts; `result()` gives the merged dict."""

    def __init__(self) -> None:
        self._acc: dict[str, list[float]] = {}  # name -> [value, weight sum]
        self._order: list[str] = []

    def add(self, metrics: Mapping[str, Any], weight: float = 1.0) -> None:
        """Add one update's metrics; `weight` (> 0) counts for the weighted means."""
        if not weight > 0:
            raise ValueError(f"MetricsAggregator.add: weight={weight!r} must be > 0")
        for name, raw in metrics.items():
            value = _as_float(name, raw)
            how = reduction_for(name)
            acc = self._acc.get(name)
            if acc is None:
                self._acc[name] = [value * weight if how == "mean" else value, weight]
                self._order.append(name)
                continue
            if how == "last":
                acc[0] = value
            elif how == "sum":
                acc[0] += value
            elif how == "max":
                acc[0] = max(acc[0], value)
            elif how == "min":
                acc[0] = min(acc[0], value)
            else:
                acc[0] += value * weight
            acc[1] += weight

    def result(self) -> dict[str, float]:
        """The merged metrics, in first-seen order."""
        out = {}
        for name in self._order:
            value, weight = self._acc[name]
            out[name] = value / weight if reduction_for(name) == "mean" else value
        return out

    def reset(self) -> None:
        self._acc.clear()
        self._order.clear()

    def __len__(self) -> int:
        return len(self._acc)


def _as_float(name: str, raw: Any) -> float:
    if hasattr(raw, "item"):  # a 0-d tensor or numpy scalar
        raw = raw.item()
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise TypeError(f"metric {name!r}: {raw!r} is not a number")
    return float(raw)

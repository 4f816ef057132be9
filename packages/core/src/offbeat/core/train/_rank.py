"""What the FSDP2 and Megatron engines of one data-parallel rank share: the update count,
the rank's place in its data-parallel group, its accelerator made current in a calling
thread, the sampling temperature, and the two ends of an update (its inputs on the device
with the loss's normaliser over every rank; the `actor/*` figures of its result).

Knows the engine's `config.temperature`, its loss function and its process group; not
how the engine shards, runs forward or steps its optimizer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from offbeat.core.algorithms import LossNormalizer, global_normalizer
from offbeat.core.train import _batch

__all__ = ["DataParallelRank", "UpdateInputs"]


@dataclass
class UpdateInputs:
    """A mini-batch made ready for an update (`DataParallelRank._update_inputs`)."""

    t_start: float  # perf_counter when the update began (its time for `perf/*`)
    temperature: float
    data: dict[str, torch.Tensor]  # on the device, after the loss's `prepare`
    seqlens: list[int]  # each row's tokens (FLOPs)
    prepared: dict[str, float]  # the metrics the loss's `prepare` reported
    loss_mask: torch.Tensor
    norm: LossNormalizer  # over the whole mini-batch on every data-parallel rank


class DataParallelRank:
    """Mixed into a train engine, which sets `config` (with `temperature`), `_updates`,
    `_dp_group`, `_device`, `_accel` and `_loss_fn`."""

    config: Any
    _updates: int
    _dp_group: Any
    _device: torch.device
    _accel: Any
    _loss_fn: Any

    @property
    def global_update_count(self) -> int:
        return self._updates

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self._dp_group)

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self._dp_group)

    def _bind_device(self) -> None:
        """Make this rank's accelerator current in the calling thread: a trainer may call
        the engine from worker threads (asyncio.to_thread), whose current device is 0."""
        if self._device.type != "cpu":
            torch.get_device_module(self._device.type).set_device(self._device)

    def _temperature(self, temperature: float | None) -> float:
        t = self.config.temperature if temperature is None else temperature
        if not t > 0:
            raise ValueError(f"temperature={t!r}: must be > 0 (the rollout's sampling temperature)")
        return float(t)

    def _update_inputs(self, mini_batch: Any, temperature: float | None) -> UpdateInputs:
        """The start of an update: the mini-batch on this rank's device through the loss's
        `prepare`, its loss mask (the response mask when the batch has none) and the
        normaliser over every data-parallel rank (collective)."""
        t_start = time.perf_counter()
        temperature = self._temperature(temperature)
        self._bind_device()
        data = _batch.as_tensor_dict(mini_batch, self._device)
        seqlens = data["attention_mask"].sum(dim=-1).tolist()
        data, prepared = self._loss_fn.prepare(data)
        loss_mask = data.get("loss_mask")
        if loss_mask is None:
            loss_mask = data["loss_mask"] = data["response_mask"]
        norm = global_normalizer(
            loss_mask, horizon=self._loss_fn.horizon, group=self._dp_group, loss_scale=self.dp_size
        )
        if norm.num_tokens <= 0:
            raise ValueError("update: the mini-batch has no response tokens on any rank")
        return UpdateInputs(t_start, temperature, data, seqlens, prepared, loss_mask, norm)

    def _update_result(
        self, result: dict[str, float], grad_norm: float, lr: float, skipped: int,
        norm: LossNormalizer,
    ) -> dict[str, float]:  # fmt: skip
        """`result` (the reduced metrics) with the update's own `actor/*` figures."""
        result.update(
            {
                "actor/grad_norm": grad_norm,
                "actor/lr": lr,
                "actor/num_skipped_updates": float(skipped),
                "actor/num_tokens": norm.num_tokens,
                "actor/num_seqs": norm.num_seqs,
                "actor/max_memory_gb": self._accel.memory_stats().peak_bytes / 1e9,
            }
        )
        return result

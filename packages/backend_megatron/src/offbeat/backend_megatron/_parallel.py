"""Process groups, the data-parallel wrapper and the optimizer of the Megatron engine.

Knows nothing about batches or losses. Two optimizer paths, chosen by `optimizer`:

- ``megatron``: Megatron's `DistributedDataParallel` (gradients in float32 buffers,
  reduced once per update) and its distributed optimizer (float32 master weights and Adam
  state sharded over data-parallel ranks). Megatron's optimizer and gradient buffers place
  tensors on ``cuda`` by name, so this path needs CUDA.
- ``torch``: core's AdamW and LR schedule over the plain model (exactly the FSDP2 engine's
  optimizer math), gradients averaged over data-parallel ranks with one all-reduce each,
  the grad norm summed over TP shards (replicated parameters counted once); any device,
  PP = 1. It is what runs on CPUs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from offbeat.core.train._sharding import ensure_process_group
from offbeat.core.train.optim import OptimConfig, build_lr_scheduler, build_optimizer, lr_factor

__all__ = ["MegatronOptimizer", "TorchOptimizer", "init_parallel"]


def init_parallel(accel: Any, tp: int, pp: int, seed: int = 0) -> torch.device:
    """Join the caller's process group (torchrun / env:// variables) or start a private
    single-process one, then Megatron's TP/PP/DP groups; return this rank's device."""
    from megatron.core import parallel_state as ps

    device = ensure_process_group(accel)  # core's: the same join-or-start as FSDP2's
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(
            f"world size {world} is not a multiple of tensor_model_parallel_size × "
            f"pipeline_model_parallel_size = {tp} × {pp}"
        )
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
        )
        if have != (tp, pp):
            raise ValueError(f"Megatron's groups are already TP×PP = {have}, not {(tp, pp)}")
    else:
        ps.initialize_model_parallel(tp, pp)
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return device


class TorchOptimizer:
    """AdamW + LambdaLR from core over the model's parameters; DP gradient averaging."""

    kind = "torch"

    def __init__(
        self, model: torch.nn.Module, config: OptimConfig, dp_group: Any, tp_group: Any
    ) -> None:
        self.model, self.config, self.dp_group, self.tp_group = model, config, dp_group, tp_group
        self.optimizer = build_optimizer(model.parameters(), config)
        self.scheduler = build_lr_scheduler(self.optimizer, config)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> tuple[float, bool]:
        """Average gradients over DP, clip, step; (grad norm before clipping, skipped)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        dp = dist.get_world_size(self.dp_group)
        if dp > 1:  # SUM then divide: gloo has no AVG
            for p in params:
                dist.all_reduce(p.grad, group=self.dp_group)
                p.grad.div_(dp)
        if dist.get_world_size(self.tp_group) == 1:
            if self.config.grad_clip > 0:
                norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip))
            else:
                norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        else:
            norm = self._clip_tp(params)
        skipped = not math.isfinite(norm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        self.scheduler.step()
        return norm, skipped

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])

    @torch.no_grad()
    def _clip_tp(self, params: list[torch.nn.Parameter]) -> float:
        """clip_grad_norm_ over a TP group: a TP-split parameter's shards add up, a
        replicated one counts once (on TP rank 0)."""
        first = dist.get_rank(self.tp_group) == 0
        squares = torch.zeros((), dtype=torch.float32, device=params[0].device)
        for p in params:
            if getattr(p, "tensor_model_parallel", False) or first:
                squares += p.grad.float().pow(2).sum()
        dist.all_reduce(squares, group=self.tp_group)
        norm = squares.sqrt()
        if self.config.grad_clip > 0:
            coef = torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0)
            for p in params:
                p.grad.mul_(coef.to(p.grad.dtype))
        return float(norm)

    @property
    def has_state(self) -> bool:
        return bool(self.optimizer.state)


class MegatronOptimizer:
    """Megatron DDP + distributed optimizer; the LR follows core's `lr_factor` of the
    update count (set on every param group before each step), weight decay on every
    parameter (as the FSDP2 engine's AdamW)."""

    kind = "megatron"

    def __init__(self, model: torch.nn.Module, tconfig: Any, config: OptimConfig) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.config = config
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        self.model = DistributedDataParallel(config=tconfig, ddp_config=ddp, module=model)
        oc = OptimizerConfig(
            optimizer="adam",
            lr=config.lr,
            min_lr=0.0,
            weight_decay=config.weight_decay,
            adam_beta1=float(config.betas[0]),
            adam_beta2=float(config.betas[1]),
            adam_eps=config.eps,
            clip_grad=max(config.grad_clip, 0.0),
            bf16=tconfig.bf16,
            fp16=False,
            params_dtype=tconfig.params_dtype,
            use_distributed_optimizer=True,
        )
        # {}: one param group for all (Megatron's default exempts biases and norms from decay).
        self.optimizer = get_megatron_optimizer(oc, [self.model], config_overrides={})
        self.updates = 0
        self._set_lr()

    def _set_lr(self) -> None:
        lr = self.config.lr * lr_factor(self.config, self.updates)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> tuple[float, bool]:
        """Reduce gradients over DP (and tied embeddings over PP), clip, step."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        finalize_model_grads([self.model])
        found_inf = bool(self.optimizer.prepare_grads())
        norm = float(self.optimizer.get_grad_norm())
        skipped = found_inf or not math.isfinite(norm)
        if not skipped:
            if self.config.grad_clip > 0:
                for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                    params = opt.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, self.config.grad_clip, norm)
            self.optimizer.step_with_ready_grads()
        self.updates += 1
        self._set_lr()
        return norm, skipped

    @property
    def has_state(self) -> bool:
        opts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return any(bool(getattr(o, "optimizer", o).state) for o in opts)

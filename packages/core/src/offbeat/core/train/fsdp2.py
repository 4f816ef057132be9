"""FSDP2TrainEngine: a Hugging Face causal LM sharded with `fully_shard` (one FSDP unit per
decoder layer plus the root) over a 1-D data-parallel DeviceMesh.

Knows nothing about where its batches come from, how advantages were computed or how
weights reach the rollout engines: it computes log-probs, runs one PPO mini-batch update
through a loss function (globally normalised over micro-batches and ranks), streams its
weights out one parameter at a time, and saves/loads its sharded state with DCP. Its
micro-batches and optimizer steps are spans of the caller's active trace, if any
(`offbeat.core.trace`). Log-probs come from the LM head's weight and the last hidden
states without float32 logits (`logprob_head`) where the model allows; each update
reports its model FLOPs per second and MFU (`flops`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from offbeat.core import trace
from offbeat.core.algorithms import zero_masked
from offbeat.core.algorithms.logprob_drift import DRIFT_MASK, batch_drift_sums, pop_drift_sums
from offbeat.core.data.vision import vision_model_kwargs
from offbeat.core.device import Device, current_device, get_device
from offbeat.core.train import _batch, _checkpoint, _gather, _sharding
from offbeat.core.train._metrics import MetricSums
from offbeat.core.train._rank import DataParallelRank
from offbeat.core.train.engine import (
    DTYPES,
    LossFn,
    log_prob_temperature,
    register_train_engine,
    updates_per_run,
)
from offbeat.core.train.flops import (
    decoder_shape_of,
    device_name,
    peak_tflops,
    perf_metrics,
    training_flops,
)
from offbeat.core.train.logprob_head import LogProbHead, supports_log_prob_head
from offbeat.core.train.loss import (
    STUDENT_TOPK_LOG_PROBS,
    TEACHER_TOPK_IDS,
    PPOLoss,
    ppo_loss_config,
)
from offbeat.core.train.optim import (
    OptimConfig,
    actor_optim,
    build_lr_scheduler,
    build_optimizer,
)

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

__all__ = ["FSDP2Config", "FSDP2TrainEngine", "actor_engine_config", "hf_name"]

# Prefixes that wrappers (activation checkpointing, torch.compile, FSDP1) put in front of
# parameter names; a HF loader (e.g. vLLM's load_weights) knows none of them.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass
class FSDP2Config:
    """How the FSDP2 engine builds, shards and trains its model.

    `micro_batch_size` is rows per forward/backward on each rank (gradient accumulation
    covers the rest of the rank's mini-batch shard). `param_dtype` is the compute dtype of
    gathered parameters (master weights stay float32); `export_dtype` the dtype of exported
    weights, i.e. the rollout engine's (None: the master dtype).

    `fused_log_probs`: compute log-probs (and entropy) from the last hidden states and the
    LM-head weight without float32 logits (`offbeat.core.train.logprob_head`), for models
    whose head allows it; others keep the plain path (on GPUs its two passes over the
    logits are compiled: eager they are slower than the plain path). `compile`:
    torch.compile each decoder layer (the first update compiles).
    `peak_tflops`: the device's peak for `perf/mfu` (None: `flops.PEAK_TFLOPS`'s vendor
    figure for the device and `param_dtype`; no `perf/mfu` where that is unknown).
    """

    model_path: str = ""
    device: str | None = None  # a name in offbeat.core.registry.DEVICES; None: cuda if usable
    micro_batch_size: int = 4
    temperature: float = 1.0  # the rollout's sampling temperature: logits are divided by it
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    export_dtype: str | None = None
    gradient_checkpointing: bool = False
    reshard_after_forward: bool = True
    trust_remote_code: bool = False
    # Set on the HF config before the model is built (model.override_config of a job; the
    # rollout engines get the same overrides, so both sides build the same model).
    override_config: dict[str, Any] = field(default_factory=dict)
    # With several ranks, only rank 0 reads the checkpoint and broadcasts it (the others
    # build on the meta device): one full copy of the model per host instead of per rank.
    init_on_rank0: bool = True
    fused_log_probs: bool = True
    compile: bool = False
    peak_tflops: float | None = None
    # FSDP2's CPUOffloadPolicy: parameters (and gradients) live in host memory and are
    # moved to the device for each forward (a frozen reference model on a GPU).
    offload_params: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)

    def validate(self, prefix: str = "train_engine") -> None:
        """Raise ValueError naming the key, the bad value and what would be valid."""
        if not self.temperature > 0:
            raise ValueError(f"{prefix}.temperature={self.temperature!r}: must be > 0")
        if self.micro_batch_size < 1:
            raise ValueError(f"{prefix}.micro_batch_size={self.micro_batch_size!r}: must be >= 1")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(
                f"{prefix}.peak_tflops={self.peak_tflops!r}: must be > 0, or None for the "
                "device table's figure"
            )
        for key in ("param_dtype", "reduce_dtype", "export_dtype"):
            value = getattr(self, key)
            if value is not None and value not in DTYPES:
                raise ValueError(f"{prefix}.{key}={value!r}: must be one of {sorted(DTYPES)}")
        self.optim.validate(f"{prefix}.optim")


def actor_engine_config(job: JobConfig) -> FSDP2Config:
    """The actor's FSDP2 settings, the one place that reads them from a job: model.*,
    resources.device, actor.* (micro-batches, gradient checkpointing, optimizer; the LR
    horizon is `updates_per_run`), the rollout's temperature (`log_prob_temperature`)."""
    a, m = job.actor, job.model
    return FSDP2Config(
        model_path=m.path,
        device=job.resources.device,
        micro_batch_size=a.ppo_micro_batch_size_per_device,
        temperature=log_prob_temperature(job.rollout),
        param_dtype=m.dtype,
        export_dtype=m.dtype,
        gradient_checkpointing=a.gradient_checkpointing,
        trust_remote_code=m.trust_remote_code,
        override_config=dict(m.override_config),
        optim=actor_optim(a, updates_per_run(job, a.ppo_epochs)),
    )


def hf_name(name: str) -> str:
    """A parameter name with wrapper prefixes removed (what HF state dicts call it)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def _full(param: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and param.dtype != dtype:
        param = param.to(dtype)  # each shard first: a bf16 gather moves half the bytes
    full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
    return full.contiguous()


@register_train_engine("fsdp2")
class FSDP2TrainEngine(DataParallelRank):
    """One data-parallel rank of an FSDP2-sharded HF causal LM.

    `model` may be passed already built (tests, custom models; every rank passes the same
    weights); otherwise it is loaded from `config.model_path` with `AutoModelForCausalLM`. `loss_fn` computes a
    micro-batch's share of the mini-batch loss (see `offbeat.core.train.engine.LossFn`);
    the default is `PPOLoss()` with default settings.
    With world size > 1 the caller starts torch.distributed (or sets the env:// variables);
    every rank builds the engine with the same config and calls every method.
    """

    @classmethod
    def from_job_config(
        cls, job: JobConfig, *, model: nn.Module | None = None, loss_fn: LossFn | None = None
    ) -> FSDP2TrainEngine:
        """The actor engine of a JobConfig, with its PPO loss (see `PPOLossConfig`)."""
        if loss_fn is None:
            loss_fn = PPOLoss(ppo_loss_config(job))
        return cls(actor_engine_config(job), loss_fn=loss_fn, model=model)

    @classmethod
    def reference_from_job_config(cls, job: JobConfig, *, model: nn.Module | None = None) -> Any:
        """The frozen reference policy of a JobConfig: the actor's initial model and engine
        settings (it is only ever asked for log-probs), `ref.*` micro-batches and offload."""
        config = dataclasses.replace(
            actor_engine_config(job),
            micro_batch_size=job.ref.log_prob_micro_batch_size_per_device
            or job.actor.ppo_micro_batch_size_per_device,
            offload_params=job.ref.param_offload,
        )
        return cls(config, model=model)

    def __init__(
        self, config: FSDP2Config, loss_fn: LossFn | None = None, model: nn.Module | None = None
    ) -> None:
        config.validate()
        self.config = config
        self._loss_fn: LossFn = loss_fn if loss_fn is not None else PPOLoss()
        self._accel: Device = get_device(config.device) if config.device else current_device()
        self._device = _sharding.ensure_process_group(self._accel)
        self._mesh: DeviceMesh = init_device_mesh(
            self._accel.torch_type, (dist.get_world_size(),), mesh_dim_names=("dp",)
        )
        self._dp_group = self._mesh.get_group()
        mp = MixedPrecisionPolicy(
            param_dtype=DTYPES[config.param_dtype], reduce_dtype=DTYPES[config.reduce_dtype]
        )
        if model is None:
            model = _sharding.build_sharded_model(
                config.model_path,
                self._mesh,
                self._device,
                mp,
                reshard_after_forward=config.reshard_after_forward,
                gradient_checkpointing=config.gradient_checkpointing,
                compile_layers=config.compile,
                trust_remote_code=config.trust_remote_code,
                init_on_rank0=config.init_on_rank0,
                override_config=config.override_config,
                offload=config.offload_params,
            )
        else:
            model = _sharding.shard(
                model.float(),
                self._mesh,
                mp,
                config.reshard_after_forward,
                config.gradient_checkpointing,
                compile_layers=config.compile,
                offload=config.offload_params,
            )
        self._model = model
        self._optimizer = build_optimizer(self._model.parameters(), config.optim)
        self._scheduler = build_lr_scheduler(self._optimizer, config.optim)
        self._updates = 0
        # HF causal LMs can skip the LM head on the prompt positions.
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # A vision-language model: its forward takes the prompts' vision inputs, and its
        # multimodal RoPE computes the position ids (from the image grids).
        cfg = getattr(model, "config", None)
        self._vision = getattr(cfg, "vision_config", None) is not None
        self._image_token_id = getattr(cfg, "image_token_id", None)
        self._head: LogProbHead | None = None
        if config.fused_log_probs and self._takes_logits_to_keep and supports_log_prob_head(model):
            self._head = LogProbHead.install(model, compiled=self._device.type == "cuda")
        self._shape = decoder_shape_of(model)
        self._peak = config.peak_tflops or peak_tflops(
            device_name(self._device), config.param_dtype
        )

    # ---------------------------------------------------------------- properties
    @property
    def model(self) -> nn.Module:
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def lr(self) -> float:
        """The learning rate the next update will use."""
        return float(self._optimizer.param_groups[0]["lr"])

    # ---------------------------------------------------------------- forward
    def _model_kwargs(self, mb: dict[str, Any]) -> dict[str, Any]:
        width = mb["response_mask"].shape[1]
        kwargs: dict[str, Any] = {
            "input_ids": mb["input_ids"],
            "attention_mask": mb["attention_mask"],
            "position_ids": _batch.position_ids_of(mb),
            "use_cache": False,
        }
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = width + 1  # only the positions that predict responses
        if self._vision:
            del kwargs["position_ids"]
            dtype = next(self._model.parameters()).dtype
            kwargs.update(
                vision_model_kwargs(
                    mb.get("multi_modal") or [], mb["input_ids"], self._image_token_id, dtype
                )
            )
        return kwargs

    def _response_logits(self, mb: dict[str, Any]) -> torch.Tensor:
        """The model's outputs at the positions that predict the response tokens [B, R, .]
        (the critic's values; the policy goes through `_forward`)."""
        width = mb["response_mask"].shape[1]
        return self._model(**self._model_kwargs(mb)).logits[:, -(width + 1) : -1, :]

    def _forward(
        self, mb: dict[str, Any], temperature: float, with_entropy: bool, topk: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of the response tokens. `topk`: also the log-probs of
        the ids in `mb[TEACHER_TOPK_IDS]` ([B, R, k]), written to
        `mb[STUDENT_TOPK_LOG_PROBS]` (full logits: the fused head gives one id per token)."""
        input_ids = mb["input_ids"]
        width = mb["response_mask"].shape[1]
        kwargs = self._model_kwargs(mb)
        if topk:
            logits = self._model(**kwargs).logits[:, -(width + 1) : -1, :] / temperature
            full = torch.log_softmax(logits.float(), dim=-1)
            log_probs = full.gather(-1, input_ids[:, -width:, None])[..., 0]
            mb[STUDENT_TOPK_LOG_PROBS] = full.gather(-1, mb[TEACHER_TOPK_IDS].long())
            entropy = _batch.entropy_from_logits(logits) if with_entropy else None
        elif self._head is not None:
            with self._head.request(input_ids[:, -width:], temperature, with_entropy):
                out = self._model(**kwargs).logits  # [B, W, 1 or 2]: log-prob (, entropy)
            log_probs, entropy = out[..., 0], (out[..., 1] if with_entropy else None)
        else:
            logits = self._model(**kwargs).logits[:, -(width + 1) : -1, :]
            logits = logits / temperature
            log_probs = _batch.token_log_probs(logits, input_ids[:, -width:])
            entropy = _batch.entropy_from_logits(logits) if with_entropy else None
        mask = mb["response_mask"]
        return zero_masked(log_probs, mask), (
            zero_masked(entropy, mask) if entropy is not None else None
        )

    def _max_over_ranks(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._dp_group)
        return int(t.item())

    def _micro_batches(self, batch: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
        """This rank's micro-batches, and how many forwards every rank must run (FSDP's
        collectives need the same count everywhere; short ranks repeat one with zero
        weight)."""
        micro = _batch.split_rows(batch, self.config.micro_batch_size)
        return micro, self._max_over_ranks(len(micro))

    def compute_log_probs(self, batch: Any, temperature: float | None = None) -> torch.Tensor:
        """Log-probs [B, R] (float32, on CPU) of the response tokens of this rank's batch
        at `temperature` (None: `config.temperature`); 0 where response_mask is 0."""
        temperature = self._temperature(temperature)
        self._bind_device()
        data = _batch.as_tensor_dict(batch, self._device)
        micro, rounds = self._micro_batches(data)
        self._model.eval()
        out = []
        with torch.no_grad():
            for i in range(rounds):
                with trace.span("log_prob micro-batch", index=i):
                    mb = micro[min(i, len(micro) - 1)]
                    log_probs, _ = self._forward(mb, temperature, False)
                if i < len(micro):
                    out.append(log_probs.float().cpu())
        return torch.cat(out, dim=0)

    # ---------------------------------------------------------------- update
    def update(self, mini_batch: Any, temperature: float | None = None) -> dict[str, float]:
        """One PPO mini-batch update on this rank's shard: the loss function prepares the
        whole shard, the normaliser is counted over all micro-batches and ranks, then
        forward/backward per micro-batch, clip, AdamW step, LR step.

        Returns metrics identical on every rank, named for `offbeat.core.metrics`: the loss
        function's (token means over the mini-batch; max/min names reduced as such),
        `actor/loss` (the mini-batch objective), `actor/grad_norm` (before clipping),
        `actor/lr` (the LR this step used), `actor/num_skipped_updates` (1 if the grad norm
        was not finite and the step was skipped), `actor/num_tokens` and `actor/num_seqs`
        (the normaliser's counts), `actor/max_memory_gb` (this rank's peak), and
        `perf/tflops_per_device`, `perf/mfu` (model FLOPs of the real tokens of every rank,
        `offbeat.core.train.flops`, over the slowest rank's update time). A mini-batch
        with a ``drift_mask`` field also gets `logprob_drift/*` and `logprob_drift_all/*`
        (`offbeat.core.algorithms.logprob_drift`): this update's log-probs, all computed
        before its optimizer step, against ``rollout_log_probs`` (train mode: a model with
        active dropout would add its noise)."""
        u = self._update_inputs(mini_batch, temperature)
        t_start, temperature, data, seqlens = u.t_start, u.temperature, u.data, u.seqlens
        prepared, loss_mask, norm = u.prepared, u.loss_mask, u.norm
        micro, rounds = self._micro_batches(data)
        with_entropy = bool(self._loss_fn.needs_entropy)
        with_topk = bool(getattr(self._loss_fn, "needs_topk", False))
        self._model.train()
        self._optimizer.zero_grad(set_to_none=True)
        metrics = MetricSums()
        metrics.add(prepared, float(loss_mask.sum()) / norm.num_tokens)
        objective = 0.0
        for i in range(rounds):
            real = i < len(micro)
            mb = micro[i] if real else micro[-1]
            with trace.span("micro-batch", index=i, rows=int(mb["response_mask"].shape[0])):
                # (the top-k keyword only when asked: the critic's _forward has none)
                log_probs, entropy = self._forward(
                    mb, temperature, with_entropy, **({"topk": True} if with_topk else {})
                )
                # The loss is already scaled by loss_scale = dp size: FSDP averages gradients
                # over ranks, and the sum of the shares is what the mini-batch gradient is.
                loss, mb_metrics = self._loss_fn(log_probs, entropy, mb, norm)
                if real and DRIFT_MASK in mb:  # these log-probs against the rollout's
                    metrics.add(batch_drift_sums(log_probs, mb), 1.0)
                if not real:
                    loss = loss * 0.0  # a short rank keeps FSDP's collectives in step
                loss.backward()
            if real:
                objective += float(loss.detach()) / norm.loss_scale
                metrics.add(mb_metrics, float(mb["loss_mask"].sum()) / norm.num_tokens)
        with trace.span("optimizer_step"):
            grad_norm = self._clip_grad()
            used_lr = self.lr
            skipped = not math.isfinite(grad_norm)
            if skipped:
                self._optimizer.zero_grad(set_to_none=True)
            else:
                self._optimizer.step()
            self._scheduler.step()
        self._updates += 1
        metrics.add({"actor/loss": objective}, 1.0)
        if self._shape is not None:  # FLOPs summed over ranks, the slowest rank's time
            seconds = time.perf_counter() - t_start
            flops = training_flops(self._shape, seqlens)
            metrics.add({"perf/flops": flops, "perf/max_update_s": seconds}, 1.0)
        result = pop_drift_sums(metrics.reduce(self._dp_group, self._device))
        if self._shape is not None:
            flops, seconds = result.pop("perf/flops"), result.pop("perf/max_update_s")
            result.update(perf_metrics(flops, seconds, self.dp_size, self._peak))
        return self._update_result(result, grad_norm, used_lr, skipped, norm)

    def _clip_grad(self) -> float:
        params = [p for p in self._model.parameters() if p.grad is not None]
        max_norm = self.config.optim.grad_clip
        if max_norm > 0:
            total = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            total = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(total, DTensor):
            total = total.full_tensor()
        return float(total.item())

    # ---------------------------------------------------------------- weights out
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full contiguous tensor in `export_dtype`) for every parameter, one at a
        time: a parameter is gathered only when the consumer asks for it and this generator
        drops its reference before gathering the next. All ranks must iterate to the end."""
        dtype = DTYPES[self.config.export_dtype] if self.config.export_dtype else None
        for name, param in self._model.named_parameters():
            self._bind_device()
            tensor = _full(param, dtype)
            yield hf_name(name), tensor
            del tensor

    def gather_weights(
        self, dst: int = 0, prefetch_bytes: int = 0
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Like `export_weights`, but only rank `dst` of the data-parallel group gets the
        full tensors (the sender of a weight sync): the other ranks send their shards to it,
        each shard cast to `export_dtype` first, and yield nothing. All ranks must iterate
        to the end. Each byte of the model crosses the wire once, towards `dst` alone.
        `prefetch_bytes`: how far `dst` receives ahead of the tensor it yields (0: it holds
        one full parameter at a time)."""
        dtype = DTYPES[self.config.export_dtype] if self.config.export_dtype else None
        self._bind_device()
        group, model = self._dp_group, self._model
        for name, tensor in _gather.gather_to(model, group, dst, dtype, prefetch_bytes):
            yield hf_name(name), tensor
            del tensor

    # ---------------------------------------------------------------- checkpoint
    def save(self, path: str) -> None:
        self._bind_device()
        _checkpoint.save(
            path,
            self._model,
            self._optimizer,
            {"lr_scheduler": self._scheduler.state_dict(), "global_update_count": self._updates},
            self._dp_group,
        )

    def load(self, path: str) -> None:
        self._bind_device()
        extra = _checkpoint.load(path, self._model, self._optimizer, self._dp_group)
        self._scheduler.load_state_dict(extra["lr_scheduler"])
        self._updates = int(extra["global_update_count"])

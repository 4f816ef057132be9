"""MegatronTrainEngine: offbeat's `TrainEngine` on a Megatron-Core GPTModel with tensor,
pipeline and data parallelism, built from (and exported back to) HF Qwen2/Llama weights.

Knows nothing about where batches come from or how weights reach the rollout engines: the
same contract as the FSDP2 engine (`offbeat.core.train.engine`). Each row's real tokens
are packed to the left before the forward (so attention is causal with no mask, and RoPE
positions are the running count of real tokens, as HF computes them for this layout);
log-probs come from vocabulary-parallel logits (`_logprobs`); the PPO loss is core's
`LossFn`, normalised with one `LossNormalizer` over the data-parallel mini-batch.
With PP > 1 micro-batches run through Megatron's pipeline schedule (CUDA only).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from offbeat.backend_megatron import _checkpoint, _inputs, _model
from offbeat.backend_megatron._logprobs import vocab_parallel_log_probs
from offbeat.backend_megatron._parallel import MegatronOptimizer, TorchOptimizer, init_parallel
from offbeat.backend_megatron.config import DTYPES, MegatronConfig, megatron_config
from offbeat.backend_megatron.convert import (
    DecoderSpec,
    global_name,
    join_tp_shards,
    megatron_to_hf,
    tp_split_dim,
)
from offbeat.core.algorithms import zero_masked
from offbeat.core.device import current_device, get_device
from offbeat.core.train import _batch
from offbeat.core.train._metrics import MetricSums
from offbeat.core.train._rank import DataParallelRank
from offbeat.core.train.engine import LossFn, register_train_engine
from offbeat.core.train.flops import (
    DecoderShape,
    device_name,
    peak_tflops,
    perf_metrics,
    training_flops,
)
from offbeat.core.train.loss import PPOLoss, ppo_loss_config

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

__all__ = ["MegatronConfig", "MegatronTrainEngine"]


@register_train_engine("megatron")
class MegatronTrainEngine(DataParallelRank):
    """One rank of a Megatron-Core decoder (TP × PP × DP). With world size > 1 the caller
    starts torch.distributed (or sets the env:// variables); every rank builds the engine
    with the same config and calls every method. `loss_fn` as the FSDP2 engine's."""

    @classmethod
    def from_job_config(
        cls, job: JobConfig, *, loss_fn: LossFn | None = None
    ) -> MegatronTrainEngine:
        """The actor engine of a job (`megatron_config`), with its PPO loss
        (`offbeat.core.train.ppo_loss_config`)."""
        if loss_fn is None:
            loss_fn = PPOLoss(ppo_loss_config(job))
        return cls(megatron_config(job), loss_fn=loss_fn)

    def __init__(self, config: MegatronConfig, loss_fn: LossFn | None = None) -> None:
        from megatron.core import parallel_state as ps

        config.validate()
        self.config = config
        self._loss_fn: LossFn = loss_fn if loss_fn is not None else PPOLoss()
        self._accel = get_device(config.device) if config.device else current_device()
        tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
        self._device = init_parallel(self._accel, tp, pp, config.seed)
        kind = config.optimizer
        if kind == "auto":
            kind = "megatron" if self._device.type == "cuda" else "torch"
        if kind == "torch" and (pp != 1 or config.sequence_parallel):
            raise ValueError(
                f"train_engine.optimizer=torch: runs PP = 1 without sequence parallelism, got "
                f"PP={pp}, sequence_parallel={config.sequence_parallel}; use optimizer=megatron (CUDA)"
            )
        if kind == "torch" and config.param_dtype != "float32":
            raise ValueError(
                f"train_engine.param_dtype={config.param_dtype!r} with optimizer=torch: the "
                "model's parameters are the master weights there, so they must be 'float32' "
                "(bf16 compute with float32 masters is the megatron optimizer's, on CUDA)"
            )
        if kind == "megatron" and self._device.type != "cuda":
            raise ValueError("train_engine.optimizer=megatron: needs CUDA; use optimizer=torch")
        if pp > 1 and self._device.type != "cuda":
            raise ValueError(f"pipeline_model_parallel_size={pp}: Megatron's schedule needs CUDA")
        self._hf = _model.hf_config(
            config.model_path, config.trust_remote_code, config.override_config
        )
        self.spec = DecoderSpec.from_hf_config(self._hf, vocab_multiple=tp)
        dtype = DTYPES[config.param_dtype]
        self._tconfig = _model.transformer_config(
            self._hf, tp=tp, pp=pp, dtype=dtype, sequence_parallel=config.sequence_parallel,
            on_cpu=self._device.type == "cpu",
        )  # fmt: skip
        model = _model.build_model(self._hf, self._tconfig, self.spec)
        if config.gradient_checkpointing:
            _model.checkpoint_layers(model)
        if self._device.type == "cpu":
            _model.keep_rope_on_cpu(model)
        else:
            model = model.to(self._device)
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        self._dp_group = ps.get_data_parallel_group()
        _model.load_hf_weights(model, self.spec, config.model_path, self.tp_rank, tp)
        _inputs.freeze_padding_row(model, self._hf)
        self._module = model  # unwrapped: names, export, checkpoints
        if kind == "megatron":
            self._opt: Any = MegatronOptimizer(model, self._tconfig, config.optim)
        else:
            self._opt = TorchOptimizer(model, config.optim, self._dp_group, self._tp_group)
        self._model = self._opt.model  # what runs forward (DDP-wrapped on the megatron path)
        self._updates = 0
        self._last_stage = ps.is_pipeline_last_stage()
        self._shape = DecoderShape.from_hf_config(self._hf)
        self._peak = config.peak_tflops or peak_tflops(
            device_name(self._device), config.param_dtype
        )

    # ---------------------------------------------------------------- properties
    @property
    def model(self) -> torch.nn.Module:
        return self._module

    @property
    def optimizer_kind(self) -> str:
        return self._opt.kind

    @property
    def lr(self) -> float:
        return self._opt.lr

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self._tp_group)

    # ---------------------------------------------------------------- forward
    def _run(self, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward of one micro-batch: (this stage's output, predicting columns, targets)."""
        multiple = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
        packed, column, targets = _inputs.packed(mb, multiple)
        positions = torch.arange(packed.shape[1], device=packed.device).expand_as(packed)
        out = self._model(input_ids=packed, position_ids=positions, attention_mask=None)
        return out, column, targets

    def _log_probs(
        self, logits: torch.Tensor, column: torch.Tensor, targets: torch.Tensor,
        mb: dict[str, Any], temperature: float, with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """[B, R] log-probs (and entropy) from the last stage's [B, S, V/tp] logits."""
        rows = torch.arange(logits.shape[0], device=logits.device).unsqueeze(-1)
        picked = logits[rows, column]  # [B, R, V/tp]
        b, r = targets.shape
        log_probs, entropy = vocab_parallel_log_probs(
            picked.reshape(b * r, -1), targets.reshape(-1), temperature,
            vocab_size=self.spec.vocab_size, group=self._tp_group, with_entropy=with_entropy,
        )  # fmt: skip
        mask = mb["response_mask"]
        log_probs = zero_masked(log_probs.reshape(b, r), mask)
        return log_probs, (
            zero_masked(entropy.reshape(b, r), mask) if entropy is not None else None
        )

    def _pipeline(
        self, micro: list[dict[str, Any]], loss_func: Any, forward_only: bool
    ) -> list[Any]:
        """Megatron's pipeline schedule over `micro`; `loss_func(mb, logits)` runs on the
        last stage and returns (loss, payload); the payloads come back in order there."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iterator: Iterator, model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data_iterator)
            out, column, targets = self._run(mb)
            return out, partial(loss_func, mb, column, targets)

        length = max(int(mb["attention_mask"].sum(dim=1).max()) for mb in micro)
        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(micro), model=[self._model],
            num_microbatches=len(micro), seq_length=length,
            micro_batch_size=self.config.micro_batch_size, forward_only=forward_only,
        )  # fmt: skip

    def compute_log_probs(self, batch: Any, temperature: float | None = None) -> torch.Tensor:
        """Log-probs [B, R] (float32, on CPU) of the response tokens of this rank's batch
        at `temperature` (None: `config.temperature`); 0 where response_mask is 0. Every
        rank of a model-parallel group returns the same tensor."""
        temperature = self._temperature(temperature)
        self._bind_device()
        data = _batch.as_tensor_dict(batch, self._device)
        micro = _batch.split_rows(data, self.config.micro_batch_size)
        self._model.eval()
        with torch.no_grad():
            if self.config.pipeline_model_parallel_size == 1:
                outs = []
                for mb in micro:
                    logits, column, targets = self._run(mb)
                    outs.append(self._log_probs(logits, column, targets, mb, temperature, False)[0])
                return torch.cat(outs).float().cpu()

            def keep(mb, column, targets, logits):
                lp = self._log_probs(logits, column, targets, mb, temperature, False)[0]
                return logits.new_zeros(()), {"log_probs": lp}

            got = self._pipeline(micro, keep, forward_only=True)
            shape = (_batch.num_rows(data), data["response_mask"].shape[1])
            out = (
                torch.cat([g["log_probs"] for g in got]).float()
                if self._last_stage
                else torch.empty(shape, dtype=torch.float32, device=self._device)
            )
            last = dist.get_global_rank(self._pp_group, dist.get_world_size(self._pp_group) - 1)
            dist.broadcast(out, src=last, group=self._pp_group)
            return out.cpu()

    # ---------------------------------------------------------------- update
    def update(self, mini_batch: Any, temperature: float | None = None) -> dict[str, float]:
        """One PPO mini-batch update on this rank's shard, as `FSDP2TrainEngine.update`:
        the loss function prepares the shard, one normaliser counts the loss tokens over
        the data-parallel ranks, forward/backward per micro-batch, clip, AdamW, LR step.
        Returns the same metric names, identical on every rank."""
        u = self._update_inputs(mini_batch, temperature)
        t_start, temperature, data, seqlens = u.t_start, u.temperature, u.data, u.seqlens
        prepared, loss_mask, norm = u.prepared, u.loss_mask, u.norm
        micro = _batch.split_rows(data, self.config.micro_batch_size)
        with_entropy = bool(self._loss_fn.needs_entropy)
        # Metrics come from one rank per data-parallel replica (last stage, TP rank 0).
        reports = self._last_stage and self.tp_rank == 0
        metrics = MetricSums()
        if reports:
            metrics.add(prepared, float(loss_mask.sum()) / norm.num_tokens)
        objective = 0.0
        self._model.train()
        self._opt.zero_grad()

        def loss_of(mb, column, targets, logits):
            log_probs, entropy = self._log_probs(
                logits, column, targets, mb, temperature, with_entropy
            )
            # Already scaled by loss_scale = DP size: DDP averages gradients over ranks.
            loss, mb_metrics = self._loss_fn(log_probs, entropy, mb, norm)
            return loss, (float(loss.detach()), mb_metrics, float(mb["loss_mask"].sum()))

        if self.config.pipeline_model_parallel_size == 1:
            results = []
            for mb in micro:
                logits, column, targets = self._run(mb)
                loss, payload = loss_of(mb, column, targets, logits)
                loss.backward()
                results.append(payload)
        else:  # the schedule divides each loss by the number of micro-batches: undo it
            n = len(micro)

            def scaled(mb, column, targets, logits):
                loss, payload = loss_of(mb, column, targets, logits)
                return loss * n, {"payload": payload}

            results = [g["payload"] for g in self._pipeline(micro, scaled, forward_only=False)]
        if reports:
            for value, mb_metrics, tokens in results:
                objective += value / norm.loss_scale
                metrics.add(mb_metrics, tokens / norm.num_tokens)
            metrics.add({"actor/loss": objective}, 1.0)
        used_lr = self.lr
        grad_norm, skipped = self._opt.step()
        self._updates += 1
        seconds = time.perf_counter() - t_start
        if reports:
            metrics.add(
                {"perf/flops": training_flops(self._shape, seqlens), "perf/max_update_s": seconds},
                1.0,
            )
        result = metrics.reduce(None, self._device)  # over all ranks: non-reporting add nothing
        flops, seconds = result.pop("perf/flops", 0.0), result.pop("perf/max_update_s", 0.0)
        result.update(perf_metrics(flops, seconds, dist.get_world_size(), self._peak))
        return self._update_result(result, grad_norm, used_lr, skipped, norm)

    # ---------------------------------------------------------------- weights out
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full contiguous tensor in `export_dtype`) for every parameter of this
        pipeline stage, one Megatron parameter at a time: its TP shards are gathered (a
        collective over the TP group), joined, split into HF tensors and yielded; nothing
        is kept after the consumer moves on. A tied output layer is left to the embedding.
        Every rank must iterate to the end; each stage yields its own layers."""
        dtype = DTYPES[self.config.export_dtype] if self.config.export_dtype else None
        tp = self.config.tensor_model_parallel_size
        offset = _model.layer_offset(self._module)
        for local, param in self._module.named_parameters():
            name = global_name(local, offset)
            if name == "output_layer.weight" and self.spec.tied:
                continue
            self._bind_device()
            with torch.no_grad():
                shard = param.detach() if dtype is None else param.detach().to(dtype)
                if tp > 1 and tp_split_dim(self.spec, name) is not None:
                    buffer = shard.new_empty((tp, *shard.shape))  # one allocation, TP views
                    views = list(buffer.unbind(0))
                    dist.all_gather(views, shard.contiguous(), group=self._tp_group)
                    full = join_tp_shards(self.spec, name, views)
                    del buffer
                else:
                    full = shard
                parts = megatron_to_hf(self.spec, name, full)
            del full, shard
            while parts:
                hf_name, tensor = parts.pop(0)
                yield hf_name, tensor.contiguous()
                del tensor

    # ---------------------------------------------------------------- checkpoint
    def _check_checkpointable(self) -> None:
        if self._opt.kind == "torch" and self.config.tensor_model_parallel_size > 1:
            # Core's DCP checkpoint names a parameter once; TP shards share that name.
            raise NotImplementedError(
                "save/load with train_engine.optimizer=torch at tensor_model_parallel_size="
                f"{self.config.tensor_model_parallel_size}: use optimizer=megatron (CUDA) or TP=1"
            )

    def save(self, path: str) -> None:
        self._check_checkpointable()
        self._bind_device()
        _checkpoint.save(path, self._module, self._opt, {"global_update_count": self._updates})

    def load(self, path: str) -> None:
        self._check_checkpointable()
        self._bind_device()
        extra = _checkpoint.load(path, self._module, self._opt)
        self._updates = int(extra["global_update_count"])
        if isinstance(self._opt, MegatronOptimizer):
            self._opt.updates = self._updates
            self._opt._set_lr()

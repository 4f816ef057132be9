"""The Megatron engine's config: what it builds (model, dtypes), how it splits it (TP, PP,
sequence parallelism), how it optimises (optimizer path, `OptimConfig`).

Knows nothing about megatron-core itself: a plain dataclass that a Hydra job fills through
`megatron_config` and that validates itself with errors naming the key and what is valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from offbeat.core.train.engine import DTYPES
from offbeat.core.train.optim import OptimConfig

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

__all__ = ["DTYPES", "OPTIMIZERS", "MegatronConfig", "megatron_config"]

OPTIMIZERS = ("auto", "megatron", "torch")


@dataclass
class MegatronConfig:
    """How the Megatron engine builds, splits and trains its model.

    Field names and meanings follow `offbeat.core.train.FSDP2Config` where they overlap.
    `param_dtype` is the model's dtype (with the ``megatron`` optimizer, float32 master
    weights live in the distributed optimizer); `optimizer`: ``megatron`` (DDP +
    distributed optimizer, CUDA), ``torch`` (core's AdamW, PP = 1, any device) or
    ``auto`` (megatron on CUDA, torch elsewhere). `gradient_checkpointing` recomputes each
    decoder layer in backward.
    """

    model_path: str = ""
    device: str | None = None
    micro_batch_size: int = 4
    temperature: float = 1.0
    param_dtype: str = "float32"
    export_dtype: str | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    optimizer: str = "auto"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    override_config: dict[str, Any] = field(default_factory=dict)
    peak_tflops: float | None = None
    seed: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)

    def validate(self, prefix: str = "train_engine") -> None:
        """Raise ValueError naming the key, the bad value and what would be valid."""
        if not self.temperature > 0:
            raise ValueError(f"{prefix}.temperature={self.temperature!r}: must be > 0")
        for key in (
            "micro_batch_size",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"{prefix}.{key}={getattr(self, key)!r}: must be >= 1")
        for key in ("param_dtype", "export_dtype"):
            value = getattr(self, key)
            if value is not None and value not in DTYPES:
                raise ValueError(f"{prefix}.{key}={value!r}: must be one of {sorted(DTYPES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"{prefix}.optimizer={self.optimizer!r}: must be one of {OPTIMIZERS}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                f"{prefix}.sequence_parallel=True: needs tensor_model_parallel_size > 1"
            )
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"{prefix}.peak_tflops={self.peak_tflops!r}: must be > 0, or None")
        self.optim.validate(f"{prefix}.optim")


def megatron_config(job: JobConfig) -> MegatronConfig:
    """The actor's Megatron settings, the one place that reads them from a job: as the
    FSDP2 engine's (`offbeat.core.train.actor_engine_config`), plus the actor's TP and PP
    sizes and trainer.seed."""
    from offbeat.core.train import actor_engine_config

    base = actor_engine_config(job)
    return MegatronConfig(
        model_path=base.model_path,
        device=base.device,
        micro_batch_size=base.micro_batch_size,
        temperature=base.temperature,
        param_dtype=base.param_dtype,
        export_dtype=base.export_dtype,
        tensor_model_parallel_size=job.actor.tensor_model_parallel_size,
        pipeline_model_parallel_size=job.actor.pipeline_model_parallel_size,
        gradient_checkpointing=base.gradient_checkpointing,
        trust_remote_code=base.trust_remote_code,
        override_config=base.override_config,
        seed=job.trainer.seed,
        optim=base.optim,
    )

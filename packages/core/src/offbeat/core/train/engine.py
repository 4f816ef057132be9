"""The TrainEngine contract: what a trainer asks of a training backend, and the registry of
backends (FSDP2 here; Megatron in offbeat-backend-megatron).

Knows nothing about replay buffers, rollout or weight-sync transports: an engine turns a
padded tensor batch into log-probs or one optimizer step, streams its weights out as
(HF name, tensor) pairs, and saves/loads its own sharded state. Every rank of a
data-parallel group runs the same calls on its own shard of the batch.

Tensor batch layout (a `Mapping[str, Tensor]`, or any object with these attributes), local
to the calling rank:

- ``input_ids`` [B, S] int64: each row is the prompt followed by the response. Padding may
  be anywhere as long as ``attention_mask`` marks the real tokens and the responses occupy
  the last R columns (prompts left-padded, responses right-padded is the usual layout).
- ``attention_mask`` [B, S]: 1 for real tokens.
- ``response_mask`` [B, R]: 1 for the response tokens that count (R = its width).
- ``position_ids`` [B, S], optional: defaults to the running count of real tokens.

`update` additionally reads [B, R] tensors named by the loss function, by default
``advantages``, ``old_log_probs`` (proximal policy), and optionally ``rollout_log_probs``
(behaviour policy) and ``ref_log_probs``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from offbeat.core.algorithms import LossNormalizer
from offbeat.core.registry import TRAIN_ENGINES

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig, RolloutConfig

__all__ = [
    "DTYPES",
    "TRAIN_ENGINES",
    "LossFn",
    "TrainEngine",
    "batch_field",
    "build_actor_engine",
    "build_critic_engine",
    "build_reference_engine",
    "build_train_engine",
    "critic_engine",
    "log_prob_temperature",
    "register_critic_engine",
    "register_train_engine",
    "updates_per_run",
]

# The dtypes an engine config may name (param, reduce, export), by name.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@runtime_checkable
class LossFn(Protocol):
    """What an engine optimises (e.g. `offbeat.core.train.loss.PPOLoss`).

    `prepare` sees this rank's whole mini-batch once and may add fields; its
    ``loss_mask`` (default: ``response_mask``) is what the engine counts, over all
    micro-batches and ranks, into the `LossNormalizer` (with `horizon`, and `loss_scale`
    = data-parallel size). `__call__` returns one micro-batch's share of the mini-batch
    loss (summed over micro-batches and ranks it is the mini-batch loss) and metrics that
    are token means over the micro-batch's loss mask.
    """

    needs_entropy: bool
    horizon: float | None

    def prepare(self, mini_batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]: ...

    def __call__(
        self,
        log_probs: torch.Tensor,
        entropy: torch.Tensor | None,
        micro_batch: dict[str, Any],
        normalizer: LossNormalizer,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


def batch_field(batch: Any, name: str, required: bool = True) -> torch.Tensor | None:
    """Read `name` from a mapping or an attribute of `batch`; a missing required field names
    the fields that are there."""
    if isinstance(batch, Mapping):
        value = batch.get(name)
        have = sorted(batch.keys())
    else:
        value = getattr(batch, name, None)
        have = (
            sorted(k for k in vars(batch) if not k.startswith("_"))
            if hasattr(batch, "__dict__")
            else []
        )
    if value is None and required:
        raise KeyError(f"train batch has no field {name!r}; it has {have}")
    return value


@runtime_checkable
class TrainEngine(Protocol):
    """One data-parallel rank of a training backend.

    `update` is one PPO mini-batch update (micro-batching and gradient accumulation
    inside, then one clipped optimizer step and one LR-schedule step); the LR schedule's
    horizon counts these updates, and so does `global_update_count`.

    A class registered in `TRAIN_ENGINES` also offers `from_job_config(job, **kwargs)`, a
    classmethod that builds the policy's engine from a `offbeat.core.config.JobConfig`
    (see `build_actor_engine`), and, when it can, `reference_from_job_config` (the frozen
    initial policy: `build_reference_engine`); its critic, if any, is a class of its own
    (`register_critic_engine`). `check` names an engine that lacks what the job needs.
    """

    @property
    def lr(self) -> float: ...

    @property
    def global_update_count(self) -> int: ...

    @property
    def dp_rank(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    def compute_log_probs(self, batch: Any, temperature: float | None = None) -> torch.Tensor:
        """Log-probs [B, R] of the batch's response tokens under the current weights with
        logits divided by `temperature` (None: the engine's configured one, which should
        be the rollout's); 0 where response_mask is 0."""
        ...

    def update(self, mini_batch: Any, temperature: float | None = None) -> dict[str, float]:
        """One optimizer step on this rank's shard of a mini-batch; returns metrics that
        are already reduced over all ranks (identical on every rank)."""
        ...

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full contiguous tensor) pairs, one parameter at a time. Every rank must
        iterate it to the end (gathering a parameter is a collective)."""
        ...

    def save(self, path: str) -> None:
        """Write model, optimizer, LR schedule and update count to directory `path`
        atomically (all ranks call it)."""
        ...

    def load(self, path: str) -> None:
        """Restore what `save` wrote (all ranks call it)."""
        ...


def log_prob_temperature(rollout: RolloutConfig) -> float:
    """The temperature a train engine divides logits by: the rollout's sampling one, or 1
    for a greedy rollout (temperature 0 has no sampling distribution to match)."""
    return rollout.temperature if rollout.temperature > 0 else 1.0


def updates_per_run(job: JobConfig, ppo_epochs: int) -> int:
    """An LR schedule's horizon, in mini-batch updates: trainer.total_training_steps ×
    async_training.parameter_sync_step × `ppo_epochs` (the actor's or the critic's)."""
    return job.trainer.total_training_steps * job.async_training.parameter_sync_step * ppo_epochs


def register_train_engine(name: str) -> Callable[[type], type]:
    """Class decorator: make a TrainEngine buildable by name (e.g. from a config key)."""

    def wrap(cls: type) -> type:
        return TRAIN_ENGINES.register(name, cls)

    return wrap


def build_train_engine(name: str, *args: Any, **kwargs: Any) -> TrainEngine:
    """Build the registered engine `name`; an unknown name lists the registered ones."""
    return TRAIN_ENGINES.get(name)(*args, **kwargs)


def build_actor_engine(job: JobConfig, **kwargs: Any) -> TrainEngine:
    """The policy's engine for a `offbeat.core.config.JobConfig`: the class registered
    under `job.actor.engine`, built by its `from_job_config(job, **kwargs)`."""
    return TRAIN_ENGINES.get(job.actor.engine).from_job_config(job, **kwargs)


# Train engine name -> its critic (value model) class, for the engines that build one.
_CRITICS: dict[str, type] = {}


def register_critic_engine(name: str) -> Callable[[type], type]:
    """Class decorator: the critic (value model) of the train engine registered as `name`,
    built by its `from_job_config(job, **kwargs)`. The engine's own class need not know
    it (a critic usually subclasses the engine)."""

    def wrap(cls: type) -> type:
        _CRITICS[name] = cls
        return cls

    return wrap


def critic_engine(name: str) -> type | None:
    """The critic class of the train engine registered as `name` (None: it builds none);
    an unknown name lists the registered engines."""
    TRAIN_ENGINES.get(name)  # loads the engine's module, which registers its critic
    return _CRITICS.get(name)


def build_critic_engine(job: JobConfig, **kwargs: Any) -> Any:
    """The critic (value model) for a JobConfig: the class registered for
    `job.critic.engine` (`register_critic_engine`), built by its
    `from_job_config(job, **kwargs)`; it offers `compute_values(batch) -> [B, R]`,
    `update(mini_batch)`, `save`, `load`."""
    cls = critic_engine(job.critic.engine)
    if cls is None:
        raise ValueError(f"critic.engine={job.critic.engine!r}: this train engine builds no critic")
    return cls.from_job_config(job, **kwargs)


def build_reference_engine(job: JobConfig, **kwargs: Any) -> TrainEngine:
    """The frozen reference policy for a JobConfig: the class registered under
    `job.actor.engine`, built by its `reference_from_job_config(job, **kwargs)`; only its
    `compute_log_probs` is used."""
    cls = TRAIN_ENGINES.get(job.actor.engine)
    if not hasattr(cls, "reference_from_job_config"):
        raise ValueError(
            f"actor.engine={job.actor.engine!r}: this train engine builds no reference model"
        )
    return cls.reference_from_job_config(job, **kwargs)

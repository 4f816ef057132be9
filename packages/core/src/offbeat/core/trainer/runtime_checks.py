"""Validation rules for what `offbeat.core.trainer.job` does with a config: where weights
can travel, which devices the replicas get, what reaches the rollout engine, how long the
data lasts and whether a warm start applies.

Registered with `@check` on import (job.py imports this module), they run for every config
that has a `runtime` section (a `RunConfig`); plain `JobConfig`s skip them. Knows the job's
config and the checkpoint-engine and model registries; starts nothing (reading a model's
HF config and a parquet footer is the most it does).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from offbeat.core.config.validation import Problems, check

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

__all__ = ["OWNED_ENGINE_KWARGS"]

# Engine arguments that the job derives from its own keys (so the trainer and the
# replicas agree); `rollout.engine_kwargs` must not set them a second time.
OWNED_ENGINE_KWARGS = {
    "model": "model.path",
    "dtype": "model.dtype (the trainer exports weights in it)",
    "hf_overrides": "model.override_config (applied by the trainer too)",
    "tokenizer": "model.tokenizer_path",
    "trust_remote_code": "model.trust_remote_code",
    "tensor_parallel_size": "rollout.tensor_parallel_size (resources count it)",
}


@check
def _weight_sync_reaches_the_replicas(cfg: JobConfig, p: Problems) -> None:
    rt = getattr(cfg, "runtime", None)
    if rt is None:
        return
    from offbeat.ckpt_engine import backends, get_backend

    name, r = rt.ckpt_backend, cfg.resources
    if name not in backends():
        return  # reported by the job's own rule, with the registered names
    backend = get_backend(name)
    if backend.reach == "process":
        p.add(
            "runtime.ckpt_backend",
            name,
            f"{name!r} needs the receivers in the trainer's process, but every replica is a "
            f"Ray actor of its own; use one of "
            f"{sorted(b for b in backends() if get_backend(b).reach != 'process')}",
        )
    if backend.device_types and r.device not in backend.device_types:
        p.add(
            "runtime.ckpt_backend",
            name,
            f"{name!r} needs resources.device in {list(backend.device_types)}, got "
            f"{r.device!r}; use shm",
        )
    if type(r.num_nodes) is int and r.num_nodes > 1 and name != "broadcast":
        if backend.reach != "cluster":
            why = f"{name!r} moves weights within one machine only"
        else:
            why = f"the job starts {name!r} without options that cross machines"
        p.add(
            "runtime.ckpt_backend",
            name,
            f"resources.num_nodes={r.num_nodes} may put the trainer and the replicas on "
            f"different machines and {why}; use broadcast (its store binds trainer rank "
            f"0's node address)",
        )


@check
def _replicas_get_the_configured_device(cfg: JobConfig, p: Problems) -> None:
    rt = getattr(cfg, "runtime", None)
    if rt is None:
        return
    device, gpus, tp = cfg.resources.device, rt.rollout_num_gpus, cfg.rollout.tensor_parallel_size
    if device == "cuda" and gpus != tp:
        p.add(
            "runtime.rollout_num_gpus",
            gpus,
            f"with resources.device='cuda' each replica is given its "
            f"rollout.tensor_parallel_size={tp} GPUs: set {tp}",
        )
    share = bool(getattr(rt, "share_trainer_gpu", False))
    if share:
        _one_gpu_is_shared_safely(cfg, p)
    if device == "cuda" and not rt.ray_address and type(cfg.resources.devices_per_node) is int:
        import torch

        # one node: the trainer's GPU + the replicas' (shared: the last replica's)
        need = cfg.resources.devices_per_node - (1 if share else 0)
        if torch.cuda.is_available() and torch.cuda.device_count() < need:
            p.add(
                "resources.devices_per_node",
                need,
                f"this machine has {torch.cuda.device_count()} visible CUDA devices (a local "
                f"Ray gives the replicas the first resources.rollout_devices, the trainer "
                f"the next one)",
            )
    elif device == "cpu" and gpus:
        p.add(
            "runtime.rollout_num_gpus",
            gpus,
            "with resources.device='cpu' the replicas run on CPU: set 0 (or resources.device=cuda)",
        )


# The most of one shared GPU that its engines may take together: the rest is the trainer's
# (its weights, optimizer state, activations) and the CUDA contexts'.
SHARED_GPU_ENGINES_MAX = 0.9


def _one_gpu_is_shared_safely(cfg: JobConfig, p: Problems) -> None:
    """`runtime.share_trainer_gpu`: one local GPU holds the trainer and the engines beside
    it. Either the trainer in the driver takes the last replica's GPU, or (hybrid
    replicas, the trainer a worker group) one GPU holds everything: the one trainer rank,
    its hybrid replica and the one standalone replica. Every engine on the GPU takes
    `rollout.engine_kwargs.gpu_memory_utilization` of it while awake (a hybrid replica
    during validation, beside the standalone one), so together they must leave the
    trainer its part."""
    from offbeat.core.runtime.launch import hybrid_replicas, trainer_in_driver

    r, rt, tp = cfg.resources, cfg.runtime, cfg.rollout.tensor_parallel_size
    hybrid = hybrid_replicas(cfg)
    one_gpu = (r.trainer_devices, r.rollout_devices, tp, r.num_nodes) == (1, 1, 1, 1)
    if r.device != "cuda" or rt.ray_address or not (trainer_in_driver(cfg) or hybrid):
        p.add(
            "runtime.share_trainer_gpu",
            True,
            "shares a local GPU between the trainer and a replica: needs resources.device="
            "cuda, a local Ray, and the trainer in the driver (or hybrid replicas, "
            "trainer.validate_on_trainer_devices=true, on one GPU)",
        )
        return
    if hybrid and not one_gpu:
        p.add(
            "runtime.share_trainer_gpu",
            True,
            f"with trainer.validate_on_trainer_devices=true puts everything on one GPU: one "
            f"trainer rank and one replica of one device (resources.trainer_devices=1, "
            f"resources.rollout_devices=1, rollout.tensor_parallel_size=1, resources."
            f"num_nodes=1), got {r.trainer_devices}, {r.rollout_devices}, {tp}, {r.num_nodes}",
        )
        return
    util = cfg.rollout.engine_kwargs.get("gpu_memory_utilization")
    engines = 2 if hybrid else 1
    what = "the replica and the hybrid replica each take it" if hybrid else "the replica takes it"
    ok = isinstance(util, int | float) and not isinstance(util, bool)
    if not ok or not 0 < util * engines <= SHARED_GPU_ENGINES_MAX:
        p.add(
            "rollout.engine_kwargs.gpu_memory_utilization",
            util,
            f"with runtime.share_trainer_gpu=true the engines on the GPU must leave the "
            f"trainer its part: {what}, together at most {SHARED_GPU_ENGINES_MAX} of the GPU; "
            f"set a share of at most {SHARED_GPU_ENGINES_MAX / engines:g}, e.g. "
            f"{0.4 / engines:g}",
        )


@check
def _engine_kwargs_do_not_shadow_the_job(cfg: JobConfig, p: Problems) -> None:
    if getattr(cfg, "runtime", None) is None:
        return
    for key, owner in OWNED_ENGINE_KWARGS.items():
        if key in cfg.rollout.engine_kwargs:
            p.add(
                f"rollout.engine_kwargs.{key}",
                cfg.rollout.engine_kwargs[key],
                f"set by the job from {owner}; set that instead",
            )


def _hf_config(cfg: JobConfig) -> Any | None:
    """The model's HF config when it can be read without building anything, else None."""
    from offbeat.core.models.tiny import TINY_PREFIX

    path = cfg.model.path
    if not isinstance(path, str) or cfg.model.trust_remote_code:
        return None
    from transformers import AutoConfig

    if path.startswith(TINY_PREFIX):
        return AutoConfig.for_model("qwen2")  # what offbeat.core.models builds
    if (Path(path) / "config.json").is_file():
        return AutoConfig.from_pretrained(path)
    return None


@check
def _model_overrides_exist(cfg: JobConfig, p: Problems) -> None:
    overrides = cfg.model.override_config
    if getattr(cfg, "runtime", None) is None or not overrides:
        return
    config = _hf_config(cfg)
    if config is None:
        return
    unknown = sorted(k for k in overrides if not hasattr(config, k))
    if unknown:
        p.add(
            "model.override_config",
            dict(overrides),
            f"keys {unknown} are not in the model's HF config ({type(config).__name__}); "
            f"e.g. {sorted(config.to_dict())[:12]}",
        )


@check
def _data_lasts_one_step(cfg: JobConfig, p: Problems) -> None:
    t, d = cfg.trainer, cfg.data
    if getattr(cfg, "runtime", None) is None or t.total_epochs is None:
        return
    if not all(type(x) is int and x > 0 for x in (t.total_epochs, d.train_batch_size)):
        return  # reported on their own
    files = list(d.train_files)
    if files and not all(Path(f).is_file() for f in files):
        return  # reported on their own
    from offbeat.core.tasks.dataloader import count_rows, steps_within_epochs

    rows = count_rows(files) if files else cfg.task.n_train
    if steps_within_epochs(t.total_training_steps, t.total_epochs, rows, d.train_batch_size) < 1:
        p.add(
            "trainer.total_epochs",
            t.total_epochs,
            f"{t.total_epochs} pass(es) over {rows} training prompts hold no whole batch of "
            f"data.train_batch_size={d.train_batch_size}: raise it, or set null (steps alone)",
        )


@check
def _warm_start_has_work(cfg: JobConfig, p: Problems) -> None:
    ws = getattr(cfg, "warm_start", None)
    if ws is not None and ws.enabled is True and not (type(ws.steps) is int and ws.steps > 0):
        p.add("warm_start.steps", ws.steps, "warm_start.enabled=true needs steps > 0")


@check
def _local_ray_settings_need_a_local_ray(cfg: JobConfig, p: Problems) -> None:
    rt = getattr(cfg, "runtime", None)
    if rt is None or not rt.ray_address:
        return
    from offbeat.core.runtime.config import RuntimeConfig

    defaults = RuntimeConfig()
    for key in ("ray_num_cpus", "node_ip"):
        value = getattr(rt, key)
        if value != getattr(defaults, key):
            p.add(
                f"runtime.{key}",
                value,
                f"only read when the job starts a local Ray; runtime.ray_address="
                f"{rt.ray_address!r} joins one: leave it at {getattr(defaults, key)!r}",
            )

"""The `sglang` entry of offbeat's rollout-engine registry, and the Ray shell of a replica.

`sglang_replica(spec)` (core's `ReplicaSpec`) starts `SGLangRolloutServer` in the shared
replica actor of `offbeat.core.rollout.remote` (the actor launches the SGLang server process
and talks HTTP to it) and returns core's proxy, a `RolloutServer` / `SyncTarget` on the
driver. Knows how a job's config maps onto
`sglang.launch_server` flags; knows nothing of the trainer loop. Registered through the
`offbeat.rollout_engines` entry point, so `rollout.engine=sglang` validates and resolves
once this package is installed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from offbeat.core.config.validation import Problems, check
from offbeat.core.rollout.remote import RemoteRolloutServer, replica_actor
from offbeat.rollout_sglang.server import SGLangServerConfig

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig
    from offbeat.core.rollout.replica_spec import ReplicaSpec

# The python that runs `sglang.launch_server` (default: the actor's own).
SGLANG_PYTHON = "OFFBEAT_SGLANG_PYTHON"

__all__ = [
    "MISSING",
    "SGLANG_PYTHON",
    "VLLM_ONLY_KEYS",
    "build",
    "register",
    "server_args_of",
    "sglang_proxy",
    "sglang_replica",
    "sglang_server_actor",
]


# vLLM engine arguments a recipe written for vLLM may carry, and SGLang's names for them.
VLLM_ONLY_KEYS = {
    "max_model_len": "context_length",
    "enforce_eager": "disable_cuda_graph",
    "max_num_seqs": "max_running_requests",
    "seed": "random_seed",
    "gpu_memory_utilization": "mem_fraction_static",
    "tensor_parallel_size": "tp_size (set rollout.tensor_parallel_size)",
    "hf_overrides": "json_model_override_args (set model.override_config)",
}


def _vllm_keys(engine_kwargs: Mapping[str, Any]) -> list[str]:
    """The vLLM-only keys `engine_kwargs` sets (a key set to null is dropped, not set)."""
    return sorted(k for k, v in engine_kwargs.items() if k in VLLM_ONLY_KEYS and v is not None)


def _why(k: str) -> str:
    return (
        f"is vLLM's; with rollout.engine=sglang, rollout.engine_kwargs are "
        f"sglang.launch_server arguments: SGLang's is {VLLM_ONLY_KEYS[k]} "
        f"(rollout.engine_kwargs.{k}=null drops the recipe's)"
    )


@check
def _no_vllm_engine_kwargs(cfg: JobConfig, p: Problems) -> None:
    """`rollout.engine=sglang` with a vLLM engine argument fails before anything starts."""
    rollout = getattr(cfg, "rollout", None)
    if rollout is None or rollout.engine != "sglang" or not rollout.engine_kwargs:
        return
    for k in _vllm_keys(rollout.engine_kwargs):
        p.add(f"rollout.engine_kwargs.{k}", rollout.engine_kwargs[k], _why(k))


def server_args_of(job: JobConfig) -> dict[str, Any]:
    """`sglang.launch_server` arguments for `job`: what the job config owns (dtype, tensor
    parallelism, tokenizer, remote-code switch, HF config overrides) plus
    `rollout.engine_kwargs`, which are SGLang `ServerArgs` fields here (a key set to null
    is left out). Raises ValueError naming each vLLM-only key (with SGLang's name for it)
    before anything starts (validation says the same, `_no_vllm_engine_kwargs`)."""
    import json

    kwargs = {k: v for k, v in job.rollout.engine_kwargs.items() if v is not None}
    vllm_keys = _vllm_keys(kwargs)
    if vllm_keys:
        raise ValueError(
            "rollout.engine=sglang: "
            + "; ".join(f"rollout.engine_kwargs.{k}={kwargs[k]!r} {_why(k)}" for k in vllm_keys)
        )
    m = job.model
    args: dict[str, Any] = {
        "dtype": m.dtype,
        "tp_size": job.rollout.tensor_parallel_size,
        "trust_remote_code": bool(m.trust_remote_code),
    }
    if m.override_config:
        args["json_model_override_args"] = json.dumps(dict(m.override_config))
    if m.tokenizer_path:
        args["tokenizer_path"] = m.tokenizer_path
    return {**args, **kwargs}


# What an SGLang server lacks of the protocol (the shared proxy says so).
MISSING = ("generate_group", "compute_log_probs", "compute_top_log_probs", "device_memory")

BUILD = "offbeat.rollout_sglang.replica:build"


def build(config: SGLangServerConfig, cpus: Sequence[int]) -> Any:
    """In the replica's actor: confine the process to `cpus` (the SGLang server process it
    launches and everything that one starts inherit it), then launch and attach."""
    from offbeat.rollout_sglang.server import SGLangRolloutServer

    if cpus:
        from offbeat.core.cpus import pin_process

        pin_process(list(cpus))
    return SGLangRolloutServer(config)


def sglang_server_actor(
    config: SGLangServerConfig, *, cpus: Sequence[int] | None = None, **ray_options: Any
) -> Any:
    """Start `SGLangRolloutServer(config)` in the shared replica actor
    (`offbeat.core.rollout.remote`); return its handle. `cpus`: cores that the actor, the
    SGLang server process it launches and everything that one starts are confined to
    (None or empty: no confinement)."""
    return replica_actor(BUILD, config, cpus=cpus, **ray_options)


def sglang_proxy(handle: Any, weight_version: int | None = None) -> RemoteRolloutServer:
    """The driver's view of an SGLang replica's actor: core's `RemoteRolloutServer`, with
    what SGLang lacks marked missing."""
    return RemoteRolloutServer(handle, weight_version, missing=MISSING)


def sglang_replica(spec: ReplicaSpec) -> Any:
    """Start `spec` (replica `index` of a RunConfig on `model_path`) as a Ray actor:
    `spec.ray_options` (the `scheduling_strategy` of its bundle in the rollout pool, a
    hybrid replica's place) go to the actor; `spec.cpus` default to its share of
    `runtime.rollout_cpus`."""
    from offbeat.core.cpus import share_of
    from offbeat.core.process_log import replica_log_env, replica_log_path

    job, index, cpus = spec.job, spec.index, spec.cpus
    rt = job.runtime
    if cpus is None and rt.rollout_cpus:  # the same share a vLLM replica takes
        replicas = max(1, job.resources.rollout_devices // job.rollout.tensor_parallel_size)
        cpus = share_of(list(rt.rollout_cpus), replicas, index)
    # SGLang's CUDA stack usually lives in an environment of its own: name its python.
    python = os.environ.get(SGLANG_PYTHON)
    server_id = spec.name
    # The actor's process writes to a file under the run's log directory and the server
    # process to one beside it, unless trainer.verbose keeps the actor's on the console.
    log = replica_log_path(job, server_id)
    config = SGLangServerConfig(
        model=spec.model_path,
        server_args=server_args_of(job),
        server_id=server_id,
        env=dict(rt.rollout_env),
        command=[python, "-m", "sglang.launch_server"] if python else None,
        log_path=str(log.with_suffix(".server.log")) if log is not None else None,
    )
    options = {
        "num_cpus": rt.rollout_num_cpus,
        "num_gpus": rt.rollout_num_gpus,
        **spec.ray_options,
    }
    if log is not None:
        options["runtime_env"] = {"env_vars": replica_log_env(log)}
    handle = sglang_server_actor(config, cpus=cpus, **options)
    return sglang_proxy(handle, weight_version=config.weight_version)


def register() -> None:
    """Entry-point hook: put `sglang` into offbeat.core's ROLLOUT_ENGINES."""
    from offbeat.core.registry import ROLLOUT_ENGINES

    if "sglang" not in ROLLOUT_ENGINES.registered():
        ROLLOUT_ENGINES.register("sglang", sglang_replica)

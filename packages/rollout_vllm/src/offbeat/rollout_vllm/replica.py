"""The `vllm` entry of offbeat's rollout-engine registry: one replica from a job config.

Knows how a job's config maps onto a vLLM replica (a Ray actor seen through the
RolloutServer protocol); knows nothing of the trainer loop that uses it. Registered through
the `offbeat.rollout_engines` entry point, so `rollout.engine=vllm` validates and resolves
as soon as this package is installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["register", "vllm_replica"]


def vllm_replica(job: Any, model_path: str, index: int) -> Any:
    """Start replica `index` of `job` (a RunConfig) on `model_path` as a Ray actor."""
    from offbeat.rollout_vllm.actor import RemoteRolloutServer, vllm_server_actor
    from offbeat.rollout_vllm.server import VLLMServerConfig

    rt = job.runtime
    engine_kwargs = {
        "dtype": job.model.dtype,
        "tensor_parallel_size": job.rollout.tensor_parallel_size,
        **job.rollout.engine_kwargs,
    }
    config = VLLMServerConfig(
        model=model_path, engine_kwargs=engine_kwargs, server_id=f"rollout-{index}"
    )
    handle = vllm_server_actor(
        config,
        num_cpus=rt.rollout_num_cpus,
        num_gpus=rt.rollout_num_gpus,
        runtime_env={"env_vars": dict(rt.rollout_env)},
    )
    # The proxy knows the version the replica starts with: reading it never asks the actor.
    return RemoteRolloutServer(handle, weight_version=config.weight_version)


def register() -> None:
    """Entry-point hook: put `vllm` into offbeat.core's ROLLOUT_ENGINES."""
    from offbeat.core.registry import ROLLOUT_ENGINES

    if "vllm" not in ROLLOUT_ENGINES.registered():
        ROLLOUT_ENGINES.register("vllm", vllm_replica)

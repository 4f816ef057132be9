"""The `vllm` entry of offbeat's rollout-engine registry: one replica from a job config.

Knows how a job's config maps onto a vLLM replica (a Ray actor seen through the
RolloutServer protocol); knows nothing of the trainer loop that uses it. Registered through
the `offbeat.rollout_engines` entry point, so `rollout.engine=vllm` validates and resolves
as soon as this package is installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["engine_kwargs_of", "register", "vllm_replica"]


def engine_kwargs_of(job: Any) -> dict[str, Any]:
    """vLLM's engine arguments for `job`: what the job config owns (the model's dtype, HF
    config overrides, tokenizer and remote-code switch, the rollout's tensor parallelism),
    so the replicas see the model exactly as the trainer does, plus `rollout.engine_kwargs`
    (validation keeps those from setting the owned keys)."""
    m = job.model
    kwargs: dict[str, Any] = {
        "dtype": m.dtype,
        "tensor_parallel_size": job.rollout.tensor_parallel_size,
        "trust_remote_code": bool(m.trust_remote_code),
    }
    if m.override_config:
        kwargs["hf_overrides"] = dict(m.override_config)
    if m.tokenizer_path:
        kwargs["tokenizer"] = m.tokenizer_path
    return {**kwargs, **job.rollout.engine_kwargs}


def vllm_replica(job: Any, model_path: str, index: int) -> Any:
    """Start replica `index` of `job` (a RunConfig) on `model_path` as a Ray actor."""
    from offbeat.rollout_vllm.actor import RemoteRolloutServer, vllm_server_actor
    from offbeat.rollout_vllm.server import VLLMServerConfig

    rt = job.runtime
    engine_kwargs = engine_kwargs_of(job)
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

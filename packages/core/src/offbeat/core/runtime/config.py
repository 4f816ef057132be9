"""`RuntimeConfig`: where and how a job's processes run (Ray, cores, pools, timeouts,
replica replacement), the `runtime` section of a recipe's config.

Owned by the runtime; read by the job assembly, the engines' factories and the runtime's
rules (`offbeat.core.trainer.runtime_checks`). Knows nothing of what runs there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RuntimeConfig"]


@dataclass
class RuntimeConfig:
    """Where and how the job's processes run."""

    ray_address: str = ""  # "": start a local Ray (dashboard off, loopback); else join it
    ray_num_cpus: int = 2  # CPUs of the local Ray
    node_ip: str = "127.0.0.1"  # the address a local Ray binds to
    trainer_threads: int = 1  # torch threads of the trainer process
    # The resource split on a CPU-only machine (empty: no pinning). trainer_cpus: cores of
    # the driver process (the trainer) and everything it starts. rollout_cpus: cores of
    # every process of the rollout replicas (the Ray actor, the engine's processes and
    # threads), shared out among the replicas; disjoint from trainer_cpus.
    trainer_cpus: list[int] = field(default_factory=list)
    rollout_cpus: list[int] = field(default_factory=list)
    rollout_num_cpus: float = 1.0  # Ray CPUs per rollout replica actor
    rollout_num_gpus: float = 0.0  # Ray GPUs per replica (tensor_parallel_size on GPUs)
    # One GPU for the trainer and the last replica (e.g. a one-GPU machine): the trainer in
    # the driver takes the last replica's GPU instead of the next one, and the two split its
    # memory (the replica takes rollout.engine_kwargs.gpu_memory_utilization of it). With
    # hybrid replicas (trainer.validate_on_trainer_devices) the one trainer rank, its
    # hybrid replica and the one replica share one GPU (the trainer and rollout pools'
    # bundles each hold half of it; the two engines take that share each).
    # resources still count the trainer's device: devices_per_node=2 with one GPU.
    share_trainer_gpu: bool = False
    # The trainer: null (auto) runs one rank on a local one-node Ray in this process (a
    # local one-rank group: no actor, no pool bundle); otherwise resources.trainer_devices
    # rank actors on the trainer pool. Either way the loop drives a TrainerGroup.
    trainer_in_driver: bool | None = None
    trainer_num_cpus: float = 1.0  # Ray CPUs per trainer rank (its pool bundle)
    # Extra custom Ray resources each bundle of a pool asks for (pins a pool to the nodes
    # that offer them, e.g. {trainer_node: 1}).
    trainer_resources: dict[str, float] = field(default_factory=dict)
    rollout_resources: dict[str, float] = field(default_factory=dict)
    placement_timeout_s: float = 120.0  # the pools must be placed within this
    rollout_env: dict[str, str] = field(
        default_factory=lambda: {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    )
    max_concurrent_groups: int = 32  # prompt groups generated at once
    ckpt_backend: str = "shm"  # a name in offbeat.ckpt_engine.backends()
    sync_timeout_s: float = 300.0
    # Release each replica's KV cache around a weight sync's transfer (false: keep it; the
    # transfer then needs no memory on the replica's side beyond what its backend maps,
    # as with cuda_ipc into vLLM's direct-copy path).
    sync_release_kv: bool = True
    # Stop the run when this many train batches' worth of prompt groups in a row fail
    # (reward or engine errors) with none finishing: the rollout has nothing to train on.
    max_failed_batches: int = 3
    # A rollout replica that dies (or fails a weight sync) is removed and a new one is
    # started in its bundle: up to this many failed starts in a row (0: only remove), the
    # first at once, retry k after replica_replace_backoff_s * 2**(k-1) seconds. It joins
    # the balancer once it holds the trainer's weight version.
    replica_replace_attempts: int = 3
    replica_replace_backoff_s: float = 5.0
    replica_ready_timeout_s: float = 600.0  # a replacement must answer within this
    checkpoint_keep_last: int = 2
    progress_bar: bool = True

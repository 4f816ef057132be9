"""Validation rules of the `runtime` section (`RuntimeConfig`): its own values (backend,
counts, the cores of this machine), the trainer group and the pools (with a critic /
reference model in a group of its own),
hybrid replicas (`trainer.validate_on_trainer_devices`) against that resource split, and
the replacement of dead replicas (`runtime.replica_replace_*`).

Registered with `@check` on import (the job imports this module); they run for configs
with a `runtime` section. Knows only the config; starts nothing (whether the cluster can
hold the pools is known only once Ray is up: `ResourcePools.create` says so then).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from offbeat.core.config.validation import Problems, check
from offbeat.core.cpus import machine_cpus

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig


def _positive(p: Problems, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        p.add(key, value, "a number > 0")


@check
def _runtime_values(cfg: JobConfig, p: Problems) -> None:
    """The runtime's own values: a checkpoint-engine backend that exists, positive counts,
    and cores of this machine for the trainer and the rollout (disjoint)."""
    rt = getattr(cfg, "runtime", None)
    if rt is None:
        return
    from offbeat.ckpt_engine import backends

    if rt.ckpt_backend not in backends():
        p.add("runtime.ckpt_backend", rt.ckpt_backend, f"one of {sorted(backends())}")
    p.require_int("runtime.max_concurrent_groups", rt.max_concurrent_groups)
    usable = sorted(os.sched_getaffinity(0))
    bad_cpus = [c for c in rt.trainer_cpus if c not in usable]
    if bad_cpus:
        p.add("runtime.trainer_cpus", list(rt.trainer_cpus), f"cores of this machine: {usable}")
    p.require_int("runtime.trainer_threads", rt.trainer_threads)
    p.require_int("runtime.max_failed_batches", rt.max_failed_batches)


@check
def _rollout_cpus(cfg: JobConfig, p: Problems) -> None:
    rt = getattr(cfg, "runtime", None)
    if rt is None or not rt.rollout_cpus:
        return
    usable = machine_cpus()
    cpus = list(rt.rollout_cpus)
    if any(isinstance(c, bool) or not isinstance(c, int) for c in cpus):
        p.add("runtime.rollout_cpus", cpus, f"core ids (ints) of this machine: {usable}")
        return
    if [c for c in cpus if c not in usable]:
        p.add("runtime.rollout_cpus", cpus, f"cores of this machine: {usable}")
    elif len(set(cpus)) != len(cpus):
        p.add("runtime.rollout_cpus", cpus, "each core once")
    shared = sorted(set(cpus) & set(rt.trainer_cpus))
    if shared:
        p.add(
            "runtime.rollout_cpus",
            cpus,
            f"cores disjoint from runtime.trainer_cpus={list(rt.trainer_cpus)} (both name "
            f"{shared})",
        )


@check
def _trainer_group_rules(cfg: JobConfig, p: Problems) -> None:
    rt = getattr(cfg, "runtime", None)
    if rt is None:
        return
    r = cfg.resources
    _positive(p, "runtime.trainer_num_cpus", rt.trainer_num_cpus)
    _positive(p, "runtime.placement_timeout_s", rt.placement_timeout_s)
    for key in ("trainer_resources", "rollout_resources"):
        for name, amount in dict(getattr(rt, key)).items():
            if name in ("CPU", "GPU") or isinstance(amount, bool):
                p.add(
                    f"runtime.{key}.{name}",
                    amount,
                    "a custom Ray resource name with an amount > 0 (CPUs and devices come "
                    "from runtime.*_num_cpus and resources.*_devices)",
                )
            else:
                _positive(p, f"runtime.{key}.{name}", amount)
    if rt.trainer_in_driver is True:
        from offbeat.core.config.support import SEPARATE_SECTIONS, separate_groups

        for role in separate_groups(cfg):
            p.add(
                "runtime.trainer_in_driver",
                True,
                f"{SEPARATE_SECTIONS[role]}.placement=separate starts worker groups, the "
                f"trainer's among them: set null (auto) or false",
            )
        if type(r.trainer_devices) is int and r.trainer_devices > 1:
            p.add(
                "runtime.trainer_in_driver",
                True,
                f"the driver holds one trainer rank; resources.trainer_devices="
                f"{r.trainer_devices} runs as a worker group: set null (auto) or false",
            )
        if type(r.num_nodes) is int and r.num_nodes > 1:
            p.add(
                "runtime.trainer_in_driver",
                True,
                f"with resources.num_nodes={r.num_nodes} the trainer runs on its pool's node "
                f"and syncs from there: set null (auto) or false",
            )


@check
def _hybrid_replica_rules(cfg: JobConfig, p: Problems) -> None:
    """`trainer.validate_on_trainer_devices` against the resource split: hybrid replicas
    live in the trainer pool, one per trainer rank, beside it."""
    rt, t = getattr(cfg, "runtime", None), cfg.trainer
    if rt is None:
        return
    if t.hybrid_sleep_level not in (1, 2) or isinstance(t.hybrid_sleep_level, bool):
        p.add(
            "trainer.hybrid_sleep_level",
            t.hybrid_sleep_level,
            "1 (free the KV cache, offload the weights) or 2 (free both)",
        )
    key = "trainer.validate_on_trainer_devices"
    if t.validate_on_trainer_devices is not True:
        from offbeat.core.config.schema import TrainerConfig

        if t.hybrid_sleep_level != TrainerConfig.hybrid_sleep_level:
            p.add(
                "trainer.hybrid_sleep_level",
                t.hybrid_sleep_level,
                f"the default ({TrainerConfig.hybrid_sleep_level}) unless {key}=true "
                "(nothing else reads it)",
            )
        return
    if rt.trainer_in_driver is True:
        p.add(
            key,
            True,
            "a trainer pool for the hybrid replicas to live in, but runtime.trainer_in_driver="
            "true runs the trainer in the driver: set runtime.trainer_in_driver to null "
            "(auto) or false",
        )
    tp = cfg.rollout.tensor_parallel_size
    if tp != 1:
        p.add(
            key,
            True,
            f"rollout.tensor_parallel_size=1: a hybrid replica lives in one trainer rank's "
            f"bundle (one device), got rollout.tensor_parallel_size={tp}",
        )
    if not (t.test_freq > 0 or t.val_before_train):
        p.add(
            key,
            True,
            f"validation to serve: hybrid replicas wake only for it, but trainer.test_freq="
            f"{t.test_freq} and trainer.val_before_train={t.val_before_train}",
        )
    r = cfg.resources
    if rt.ray_address or not all(
        isinstance(v, int | float) and not isinstance(v, bool)
        for v in (rt.ray_num_cpus, rt.trainer_num_cpus, rt.rollout_num_cpus)
    ):
        return
    if type(r.trainer_devices) is not int or type(r.rollout_devices) is not int or tp < 1:
        return
    need = r.trainer_devices * (rt.trainer_num_cpus + rt.rollout_num_cpus)
    need += (r.rollout_devices // tp) * rt.rollout_num_cpus
    if rt.ray_num_cpus < need:
        p.add(
            "runtime.ray_num_cpus",
            rt.ray_num_cpus,
            f">= {need:g}: with {key}=true each of the {r.trainer_devices} trainer bundles "
            f"holds a rank (runtime.trainer_num_cpus={rt.trainer_num_cpus:g}) and a hybrid "
            f"replica (runtime.rollout_num_cpus={rt.rollout_num_cpus:g}), beside "
            f"{r.rollout_devices // tp} standalone replica bundles",
        )


@check
def _replacement_rules(cfg: JobConfig, p: Problems) -> None:
    rt = getattr(cfg, "runtime", None)
    if rt is None:
        return
    p.require_int("runtime.replica_replace_attempts", rt.replica_replace_attempts, minimum=0)
    _positive(p, "runtime.replica_replace_backoff_s", rt.replica_replace_backoff_s)
    _positive(p, "runtime.replica_ready_timeout_s", rt.replica_ready_timeout_s)

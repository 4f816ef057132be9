"""Each replica's share of `runtime.rollout_cpus`, and the engine-thread binding derived
from it (or checked against it when the config names one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from offbeat.rollout_vllm.replica import OMP_BIND, omp_bind, replica_cpus


def job(rollout_cpus, *, replicas=1, tp=1, device="cpu", env=None):
    return SimpleNamespace(
        runtime=SimpleNamespace(rollout_cpus=rollout_cpus, rollout_env=dict(env or {})),
        rollout=SimpleNamespace(tensor_parallel_size=tp),
        resources=SimpleNamespace(rollout_devices=replicas * tp, device=device),
    )


def test_one_replica_gets_every_rollout_core_and_its_threads_are_bound_there():
    cpus, env = replica_cpus(job([0], env={"VLLM_CPU_KVCACHE_SPACE": "1"}), 0)
    assert cpus == [0]
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", OMP_BIND: "0"}


def test_replicas_split_the_rollout_cores():
    j = job([2, 3, 4, 5], replicas=2)
    assert [replica_cpus(j, i) for i in range(2)] == [
        ([2, 3], {OMP_BIND: "2,3"}),
        ([4, 5], {OMP_BIND: "4,5"}),
    ]


def test_tensor_parallel_ranks_get_one_list_each():
    assert omp_bind([0, 1, 2, 3], 2) == "0,1|2,3"
    assert replica_cpus(job([0, 1, 2, 3], tp=2), 0) == ([0, 1, 2, 3], {OMP_BIND: "0,1|2,3"})


def test_no_rollout_cores_means_no_confinement_and_the_env_as_given():
    assert replica_cpus(job([], env={OMP_BIND: "auto"}), 0) == ([], {OMP_BIND: "auto"})


def test_on_gpus_the_processes_are_confined_but_no_thread_binding_is_added():
    assert replica_cpus(job([0, 1], device="cuda"), 0) == ([0, 1], {})


@pytest.mark.parametrize("bind", ["0-1", "1", "auto", "0|x"])
def test_a_binding_outside_the_replica_cores_is_refused_by_name(bind):
    with pytest.raises(ValueError, match=f"runtime.rollout_env.{OMP_BIND}"):
        replica_cpus(job([0], env={OMP_BIND: bind}), 0)


@pytest.mark.parametrize("bind", ["0", "nobind"])
def test_a_binding_inside_the_replica_cores_is_kept(bind):
    assert replica_cpus(job([0], env={OMP_BIND: bind}), 0) == ([0], {OMP_BIND: bind})

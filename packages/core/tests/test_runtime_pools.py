"""Resource pools (`offbeat.core.runtime.pools`): bundle shapes from a job config, the
packing check and its error, and real placement groups on a local Ray (the last tests)."""

from __future__ import annotations

import asyncio
import time

import pytest

from offbeat.core.config.run import RunConfig
from offbeat.core.runtime import PlacementError, PoolSpec, check_fit, pool_specs


def cfg_with(**kw) -> RunConfig:
    cfg = RunConfig()
    for dotted, value in kw.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def test_cpu_bundles_are_cpus_and_gpu_bundles_are_devices_plus_cpus():
    cpu = cfg_with(resources__trainer_devices=2, resources__rollout_devices=3)
    cpu.runtime.trainer_num_cpus = 2
    assert pool_specs(cpu) == [
        PoolSpec("trainer", 2, {"CPU": 2.0}),
        PoolSpec("rollout", 3, {"CPU": 1.0}),
    ]
    gpu = cfg_with(resources__device="cuda", resources__trainer_devices=4)
    gpu.resources.rollout_devices, gpu.rollout.tensor_parallel_size = 4, 2
    gpu.runtime.rollout_num_cpus, gpu.runtime.trainer_resources = 4, {"trainer_node": 1}
    assert pool_specs(gpu) == [
        PoolSpec("trainer", 4, {"CPU": 1.0, "GPU": 1.0, "trainer_node": 1.0}),
        PoolSpec("rollout", 2, {"CPU": 4.0, "GPU": 2.0}),  # one bundle per replica: TP devices
    ]
    # the trainer in the driver reserves nothing
    assert [s.name for s in pool_specs(cpu, trainer=False)] == ["rollout"]


def test_pools_that_fit_pack_onto_the_nodes():
    nodes = {"a": {"CPU": 4.0, "GPU": 2.0}, "b": {"CPU": 4.0, "GPU": 2.0}}
    check_fit([PoolSpec("trainer", 2, {"GPU": 1, "CPU": 1}),
               PoolSpec("rollout", 1, {"GPU": 2, "CPU": 2})], nodes)  # fmt: skip


def test_a_bundle_larger_than_any_node_is_refused_even_when_the_total_fits():
    nodes = {"a": {"CPU": 8.0, "GPU": 2.0}, "b": {"CPU": 8.0, "GPU": 2.0}}
    with pytest.raises(PlacementError) as e:
        check_fit([PoolSpec("rollout", 1, {"GPU": 4, "CPU": 1})], nodes)  # TP 4 on 2-GPU nodes
    msg = str(e.value)
    assert "rollout 1 × {CPU: 1, GPU: 4}" in msg  # what was asked
    assert "the cluster has {CPU: 16, GPU: 4} on 2 node(s)" in msg  # what the cluster has
    assert "a: {CPU: 8, GPU: 2}" in msg and "b: {CPU: 8, GPU: 2}" in msg


def test_too_many_cpus_names_every_pool_and_the_total():
    with pytest.raises(PlacementError) as e:
        check_fit(
            [PoolSpec("trainer", 2, {"CPU": 1}), PoolSpec("rollout", 1, {"CPU": 1})],
            {"head": {"CPU": 2.0}},
        )
    msg = str(e.value)
    assert "trainer 2 × {CPU: 1}, rollout 1 × {CPU: 1} = {CPU: 3} in all" in msg
    assert "the cluster has {CPU: 2} on 1 node(s)" in msg
    assert "bundle 0 of pool 'rollout'" in msg and "runtime.ray_num_cpus" in msg


def test_a_custom_resource_no_node_offers_is_named():
    with pytest.raises(PlacementError, match=r"judges 1 × \{CPU: 1, judge_node: 1\}"):
        check_fit([PoolSpec("judges", 1, {"CPU": 1, "judge_node": 1})], {"a": {"CPU": 4.0}})


# ---- a real local Ray ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray(ray_session):
    # A Ray of exactly 4 CPUs (what does not fit is the test), not the session's.
    ray = ray_session.own(ray_num_cpus=4)  # the job's local Ray (workers use this venv)
    yield ray
    ray.shutdown()


def eventually(check, timeout_s: float = 20.0) -> bool:
    """Ray reports resources with a lag: poll `check` until it holds (or give up)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _where(ray, pools, pool: str, index: int) -> str:
    @ray.remote(num_cpus=1)
    def placement_group_id():
        return ray.get_runtime_context().get_placement_group_id()

    return ray.get(
        placement_group_id.options(scheduling_strategy=pools.strategy(pool, index)).remote()
    )


@pytest.mark.ray
@pytest.mark.slow
def test_pools_reserve_placement_groups_and_place_tasks_in_their_bundles(local_ray):
    from offbeat.core.runtime import ResourcePools

    ray = local_ray
    specs = [
        PoolSpec("trainer", 2, {"CPU": 1}),
        PoolSpec("rollout", 1, {"CPU": 1}),
        PoolSpec("judges", 1, {"CPU": 1}),  # a recipe's named pool
    ]
    pools = asyncio.run(ResourcePools.create(specs, timeout_s=60))
    try:
        assert sorted(pools.groups) == ["judges", "rollout", "trainer"]
        free = ray.available_resources
        assert eventually(lambda: free().get("CPU", 0) == 0), free()  # all 4 CPUs reserved
        for name, pg in pools.groups.items():
            assert _where(ray, pools, name, 0) == pg.id.hex()
        assert _where(ray, pools, "trainer", 1) == pools.groups["trainer"].id.hex()
        assert sorted(pools.bundle_order("trainer")) == [0, 1]
        assert all(pools.bundle_nodes["trainer"])  # each bundle's node is known
        with pytest.raises(KeyError, match="no resource pool 'teachers'"):
            pools.strategy("teachers", 0)
    finally:
        pools.remove()
    assert eventually(lambda: ray.available_resources().get("CPU") == 4)


@pytest.mark.ray
@pytest.mark.slow
def test_pools_that_do_not_fit_reserve_nothing_and_say_why(local_ray):
    from offbeat.core.runtime import ResourcePools

    ray = local_ray
    specs = [PoolSpec("trainer", 3, {"CPU": 1}), PoolSpec("rollout", 2, {"CPU": 1})]
    with pytest.raises(PlacementError, match=r"= \{CPU: 5\} in all; the cluster has \{CPU: 4\}"):
        asyncio.run(ResourcePools.create(specs, timeout_s=60))
    # nothing was reserved: every placement group ever made here is removed
    table = ray.util.placement_group_table()
    assert all(t["state"] == "REMOVED" for t in table.values()), table
    assert eventually(lambda: ray.available_resources().get("CPU") == 4)

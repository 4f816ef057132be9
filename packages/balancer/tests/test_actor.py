"""The Ray wrapper: `BalancerActor` as a plain class (no Ray), then as a real Ray actor."""

import pytest

from offbeat.balancer import NoServerAvailable
from offbeat.balancer.actor import BalancerActor, RemoteLease, make_balancer_actor


# ---- the actor body, without Ray ----------------------------------------------------------
def test_acquire_and_release_by_record_or_id():
    actor = BalancerActor({"a": "h"})
    lease = actor.acquire("r")
    assert isinstance(lease, RemoteLease)
    assert (lease.server_id, lease.handle, lease.request_id) == ("a", "h", "r")
    assert actor.release(lease) is True
    assert actor.release(lease) is False
    other = actor.acquire("r2")
    assert actor.release(other.lease_id) is True
    assert actor.release(12345) is False
    assert actor.status()["open_leases"] == 0 and actor.inflight("a") == 0


def test_acquire_many_routes_a_grpo_group_together():
    actor = BalancerActor([f"s{i}" for i in range(4)], policy="prefix", sticky_capacity=0)
    leases = actor.acquire_many([f"g-{i}" for i in range(8)], group_id="g", prompt_ids=[1] * 64)
    assert len({x.server_id for x in leases}) == 1
    assert [x.request_id for x in leases] == [f"g-{i}" for i in range(8)]
    assert len({x.lease_id for x in leases}) == 8
    assert actor.release_many(leases + leases[:1]) == [True] * 8 + [False]
    assert actor.status()["total_inflight"] == 0


def test_acquire_many_is_all_or_nothing():
    actor = BalancerActor(["a"], max_inflight=3)
    with pytest.raises(NoServerAvailable):
        actor.acquire_many(["x", "y", "z", "w"])
    assert actor.inflight("a") == 0 and actor.status()["open_leases"] == 0


def test_membership_passes_through():
    actor = BalancerActor(["a", "b"])
    lease = actor.acquire("r")
    assert actor.remove_servers([lease.server_id], drain=True) == {lease.server_id}
    assert actor.servers() == list({"a", "b"} - {lease.server_id})
    actor.add_servers(["c"])
    assert actor.mark_unhealthy("c") and actor.mark_healthy("c")
    assert actor.release(lease) is True
    assert lease.server_id not in actor.status()["servers"]
    assert actor.clear_sticky() == 1


# ---- a real Ray actor ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray", reason="the Ray wrapper tests need the [ray] extra")
    from ray._private import ray_constants

    started = not ray.is_initialized()
    if started:
        # Under `uv run`, Ray would otherwise package the working tree and start its workers
        # through `uv run` again; the workers here share the driver's environment as it is.
        uv_hook = ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV
        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        finally:
            ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = uv_hook
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.e2e
def test_ray_actor_routes_across_processes(ray_local):
    ray = ray_local
    actor = make_balancer_actor({"a": "http://a", "b": "http://b"}, policy="prefix", seed=0)
    group = ray.get(actor.acquire_many.remote([f"g{i}" for i in range(4)], group_id="g"))
    assert len({x.server_id for x in group}) == 1
    assert group[0].handle in {"http://a", "http://b"}
    single = ray.get(actor.acquire.remote("solo"))
    assert single.server_id != group[0].server_id  # least loaded while the group is on one
    status = ray.get(actor.status.remote())
    assert status["total_inflight"] == 5 and status["open_leases"] == 5
    assert ray.get(actor.release_many.remote([*group, single, single])) == [True] * 5 + [False]
    assert ray.get(actor.status.remote())["total_inflight"] == 0
    ray.kill(actor)


@pytest.mark.ray
@pytest.mark.e2e
def test_ray_actor_raises_no_server_available(ray_local):
    ray = ray_local
    actor = make_balancer_actor()
    with pytest.raises(NoServerAvailable, match="No available servers"):
        ray.get(actor.acquire.remote("r"))
    ray.get(actor.add_servers.remote(["late"]))
    assert ray.get(actor.acquire.remote("r")).server_id == "late"
    ray.kill(actor)

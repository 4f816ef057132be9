"""Policies: the registry, round_robin, power_of_two (seeded), custom plug-ins."""

import pytest

from offbeat.balancer import (
    LoadBalancer,
    Policy,
    PowerOfTwo,
    RoundRobin,
    available_policies,
    make_policy,
    register_policy,
)


def ids(n):
    return [f"s{i}" for i in range(n)]


def test_builtin_policies_are_registered():
    assert {"least_inflight", "round_robin", "power_of_two", "prefix"} <= set(available_policies())
    assert isinstance(make_policy("round_robin"), RoundRobin)


def test_make_policy_passes_kwargs_and_takes_instances():
    p = make_policy("prefix", block_size=4)
    assert p.block_size == 4
    inst = PowerOfTwo()
    assert make_policy(inst) is inst
    with pytest.raises(TypeError):
        make_policy(inst, block_size=4)


def test_registering_a_taken_name_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_policy("least_inflight", RoundRobin)


def test_round_robin_cycles_in_registration_order_regardless_of_load():
    lb = LoadBalancer(ids(3), policy="round_robin", sticky_capacity=0)
    picks = [lb.acquire(i).server_id for i in range(7)]
    assert picks == ["s0", "s1", "s2", "s0", "s1", "s2", "s0"]


def test_round_robin_skips_unhealthy_and_full():
    lb = LoadBalancer(ids(3), policy="round_robin", sticky_capacity=0, max_inflight=1)
    lb.mark_unhealthy("s1")
    picks = [lb.acquire(i).server_id for i in range(2)]
    assert sorted(picks) == ["s0", "s2"]


def test_power_of_two_is_reproducible_with_a_seed_and_prefers_the_lighter():
    def run(seed):
        lb = LoadBalancer(ids(16), policy="power_of_two", seed=seed, sticky_capacity=0)
        return [lb.acquire(i).server_id for i in range(200)], lb

    a, lb = run(3)
    b, _ = run(3)
    assert a == b
    assert a != run(4)[0]
    loads = lb.status()["servers"].values()
    assert max(loads) - min(loads) <= 4  # two choices keep the spread small


def test_power_of_two_with_one_server():
    lb = LoadBalancer(["only"], policy="power_of_two", sticky_capacity=0)
    assert {lb.acquire(i).server_id for i in range(3)} == {"only"}


def test_power_of_two_falls_back_when_both_picks_are_full():
    lb = LoadBalancer(ids(4), policy="power_of_two", seed=0, sticky_capacity=0, max_inflight=1)
    assert sorted(lb.acquire(i).server_id for i in range(4)) == ids(4)


def test_a_custom_policy_plugs_into_the_registry():
    @register_policy("test_last_server")
    class LastServer(Policy):
        name = "test_last_server"

        def select(self, pool, request_id, group_id, prompt_ids, cost):
            active = pool.active
            return active[-1] if active else None

    lb = LoadBalancer(ids(3), policy="test_last_server")
    assert "test_last_server" in available_policies()
    assert {lb.acquire(i).server_id for i in range(5)} == {"s2"}
    lb.remove_servers(["s2"], drain=True)
    assert lb.acquire("x").server_id == "s1"


def test_a_policy_returning_none_raises_no_server_available():
    class Never(Policy):
        def select(self, pool, request_id, group_id, prompt_ids, cost):
            return None

    lb = LoadBalancer(["a"], policy=Never())
    with pytest.raises(RuntimeError, match="No available servers"):
        lb.acquire("r")

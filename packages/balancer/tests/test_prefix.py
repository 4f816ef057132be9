"""The prefix policy: block hashing, cache affinity, GRPO groups, balance thresholds."""

import pytest

from offbeat.balancer import LoadBalancer, PrefixAware, block_hashes


def ids(n):
    return [f"s{i}" for i in range(n)]


def prompt(seed, n=64):
    return [seed * 1000 + i for i in range(n)]


def test_block_hashes_are_chained_over_full_blocks():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # the partial third block is not cached
    b = block_hashes(list(range(32)) + [7] * 16, 16)
    assert a == b[:2]
    c = block_hashes([99, *range(1, 40)], 16)
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every later hash
    assert block_hashes(tuple(range(40)), 16) == a
    assert block_hashes(iter(range(40)), 16) == a

    class ArrayLike:  # numpy / torch: hash the ints, not the element objects
        def tolist(self):
            return list(range(40))

    assert block_hashes(ArrayLike(), 16) == a


def test_same_prompt_goes_where_its_prefix_is():
    lb = LoadBalancer(ids(4), policy="prefix", sticky_capacity=0)
    first = lb.acquire("a", prompt_ids=prompt(1))
    lb.release(first)
    for i in range(3):
        lb.release(lb.acquire(f"other{i}", prompt_ids=prompt(10 + i)))
    again = lb.acquire("b", prompt_ids=prompt(1) + [5] * 20)  # a longer continuation
    assert again.server_id == first.server_id


def test_a_short_shared_prefix_is_below_the_cache_threshold():
    lb = LoadBalancer(ids(2), policy="prefix", sticky_capacity=0)
    system = list(range(16))
    first = lb.acquire("a", prompt_ids=system + prompt(1, 48))
    other = lb.acquire("b", prompt_ids=system + prompt(2, 48))  # 1 of 4 blocks match
    assert other.server_id != first.server_id


def test_grpo_group_stays_together_when_load_allows():
    lb = LoadBalancer(ids(4), policy="prefix", sticky_capacity=0)
    leases = [lb.acquire(f"g0-{i}", group_id="g0") for i in range(8)]
    assert len({x.server_id for x in leases}) == 1


def test_group_moves_when_load_would_be_unbalanced():
    policy = PrefixAware(balance_abs_threshold=2, balance_rel_threshold=1.5)
    lb = LoadBalancer(ids(2), policy=policy, sticky_capacity=0)
    leases = [lb.acquire(f"g-{i}", group_id="g", prompt_ids=prompt(3)) for i in range(6)]
    servers = [x.server_id for x in leases]
    assert servers[1] == servers[0]  # 2 - 0 is within the absolute threshold
    assert servers[2] != servers[0]  # 3 - 0 > 2 and 3 > 1.5 * 0: move, and the group follows
    assert servers[3] == servers[2]
    counts = lb.status()["servers"].values()
    assert max(counts) - min(counts) <= 3


@pytest.mark.parametrize(("rel", "together"), [(100.0, True), (1.0, False)])
def test_both_thresholds_must_be_exceeded_to_move(rel, together):
    policy = PrefixAware(balance_abs_threshold=0, balance_rel_threshold=rel)
    lb = LoadBalancer(ids(2), policy=policy, sticky_capacity=0)
    lb.acquire("w0")
    lb.acquire("w1")  # loads (1, 1): any extra load exceeds the absolute threshold of 0
    servers = {lb.acquire(f"p{i}", group_id="g").server_id for i in range(5)}
    assert (len(servers) == 1) is together


def test_prefix_forgets_removed_incarnations():
    lb = LoadBalancer(ids(2), policy="prefix", sticky_capacity=0)
    first = lb.acquire("a", prompt_ids=prompt(1))
    lb.release(first)
    lb.remove_servers([first.server_id])
    lb.add_servers([first.server_id])  # restarted: its cache is gone
    for lease in [lb.acquire("x"), lb.acquire("y")]:  # one on each server ...
        if lease.server_id != first.server_id:
            lb.release(lease)  # ... then only the restarted one keeps load 1
    assert lb.status()["servers"][first.server_id] == 1 and lb.status()["total_inflight"] == 1
    again = lb.acquire("b", prompt_ids=prompt(1))
    # had it trusted the old incarnation's blocks, 1 + 1 vs 0 is within the thresholds
    assert again.server_id != first.server_id


def test_memory_is_bounded():
    policy = PrefixAware(block_size=4, max_blocks=50, max_groups=3)
    lb = LoadBalancer(ids(3), policy=policy, sticky_capacity=0)
    for i in range(40):
        lb.release(lb.acquire(i, group_id=i, prompt_ids=prompt(i, 40)))
    assert len(policy) == 50
    assert len(policy._groups) == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"max_blocks": 0},
        {"cache_threshold": 1.5},
        {"balance_rel_threshold": 0.5},
        {"balance_abs_threshold": -1},
    ],
)
def test_bad_prefix_settings_name_the_key(kwargs):
    key = next(iter(kwargs))
    with pytest.raises(ValueError, match=key):
        PrefixAware(**kwargs)

"""Unit tests for LoadBalancer semantics: leases, counts, sticky sessions, drain, health."""

import pickle

import pytest

from offbeat.balancer import Lease, LoadBalancer, NoServerAvailable


def ids(n):
    return [f"s{i}" for i in range(n)]


# ---- construction -------------------------------------------------------------------------
def test_servers_from_mapping_iterable_or_none():
    lb = LoadBalancer({"a": "http://a", "b": "http://b"})
    assert lb.servers() == ["a", "b"]
    assert lb.acquire("r").handle in {"http://a", "http://b"}
    lb2 = LoadBalancer(["x", "y"])
    assert lb2.servers() == ["x", "y"]
    assert lb2.acquire("r").handle is None
    assert LoadBalancer().servers() == []


def test_a_bare_string_is_rejected_with_a_hint():
    with pytest.raises(TypeError, match="wrap a single id in a list"):
        LoadBalancer("abc")


def test_server_ids_must_be_strings():
    with pytest.raises(TypeError, match="server ids must be str"):
        LoadBalancer({1: "x"})


def test_unknown_policy_names_the_valid_choices():
    with pytest.raises(ValueError, match=r"least_inflight.*power_of_two.*prefix.*round_robin"):
        LoadBalancer(["a"], policy="fastest")


@pytest.mark.parametrize("bad", [-1, 1.5, "10"])
def test_bad_sticky_capacity(bad):
    with pytest.raises(ValueError, match="sticky_capacity"):
        LoadBalancer(["a"], sticky_capacity=bad)


# ---- leases ---------------------------------------------------------------------------------
def test_lease_fields_and_release_once():
    lb = LoadBalancer({"a": 1})
    lease = lb.acquire("req-1")
    assert isinstance(lease, Lease)
    assert (lease.server_id, lease.handle, lease.request_id) == ("a", 1, "req-1")
    assert lb.inflight("a") == 1
    assert lb.release(lease) is True
    assert lb.release(lease) is False
    assert lb.inflight("a") == 0
    assert lease.released


def test_no_server_available_is_a_runtime_error():
    lb = LoadBalancer()
    with pytest.raises(RuntimeError, match="No available servers"):
        lb.acquire("r")
    assert issubclass(NoServerAvailable, RuntimeError)
    err = pickle.loads(pickle.dumps(NoServerAvailable("x")))
    assert str(err) == "No available servers: x"


@pytest.mark.parametrize("bad", [0, -2, 1.0, True, "1"])
def test_cost_must_be_a_positive_int(bad):
    lb = LoadBalancer(["a"])
    with pytest.raises(ValueError, match="cost"):
        lb.acquire("r", cost=bad)
    assert lb.inflight("a") == 0


def test_cost_is_summed():
    lb = LoadBalancer(["a", "b"])
    big = lb.acquire("big", cost=10)
    small = [lb.acquire(f"r{i}", cost=1) for i in range(5)]
    assert lb.inflight(big.server_id) == 10
    assert {s.server_id for s in small} == {"a", "b"} - {big.server_id}
    lb.release(big)
    assert lb.status()["total_inflight"] == 5


def test_lease_from_another_balancer_is_refused():
    a, b = LoadBalancer(["s"]), LoadBalancer(["s"])
    lease = a.acquire("r")
    with pytest.raises(ValueError, match="not issued by this LoadBalancer"):
        b.release(lease)
    assert a.release(lease) is True


def test_release_of_something_else_is_a_type_error():
    lb = LoadBalancer(["s"])
    with pytest.raises(TypeError, match="takes a Lease"):
        lb.release("s")


def test_lease_does_not_pickle():
    lease = LoadBalancer(["s"]).acquire("r")
    with pytest.raises(TypeError, match="Ray wrapper"):
        pickle.dumps(lease)


def test_inflight_of_unknown_id_is_zero():
    assert LoadBalancer(["a"]).inflight("nope") == 0


# ---- least_inflight -------------------------------------------------------------------------
def test_least_inflight_picks_the_least_loaded():
    lb = LoadBalancer(ids(3))
    held = [lb.acquire(f"r{i}") for i in range(6)]
    assert lb.status()["servers"] == {"s0": 2, "s1": 2, "s2": 2}
    lb.release(next(h for h in held if h.server_id == "s1"))
    assert lb.acquire("new").server_id == "s1"


def test_ties_rotate_on_an_idle_pool():
    lb = LoadBalancer(ids(4))
    picks = []
    for i in range(8):
        lease = lb.acquire(f"r{i}")
        picks.append(lease.server_id)
        lb.release(lease)
    assert set(picks[:4]) == set(ids(4))
    assert picks[:4] == picks[4:]


def test_seeded_choice_sequences_are_reproducible():
    def run(seed):
        lb = LoadBalancer(ids(8), seed=seed)
        out, held = [], []
        for i in range(50):
            held.append(lb.acquire(f"r{i}"))
            out.append(held[-1].server_id)
            if i % 3 == 0:
                lb.release(held.pop(0))
        return out

    assert run(7) == run(7)
    assert run(7) != run(8) or run(7) != run(9)


# ---- re-adding and removal ------------------------------------------------------------------
def test_readding_an_active_server_keeps_its_count_and_replaces_the_handle():
    lb = LoadBalancer({"a": "old"})
    lease = lb.acquire("r")
    lb.add_servers({"a": "new"})
    assert lb.inflight("a") == 1
    assert lb.acquire("r2").handle == "new"
    lb.add_servers(["a"])  # by id alone: the handle stays
    assert lb.acquire("r3").handle == "new"
    assert lb.release(lease) is True
    assert lb.inflight("a") == 2


def test_removed_then_readded_server_is_a_new_incarnation():
    lb = LoadBalancer(["a"])
    old = lb.acquire("r1")
    assert lb.remove_servers(["a"]) == {"a"}
    assert lb.status()["servers"] == {}
    assert lb.inflight("a") == 0
    lb.add_servers(["a"])
    new = lb.acquire("r2")
    assert new.incarnation != old.incarnation
    assert lb.release(old) is False  # must not decrement the new incarnation
    assert lb.inflight("a") == 1
    assert lb.release(new) is True
    assert lb.inflight("a") == 0


def test_remove_returns_what_it_did_and_ignores_unknown_ids():
    lb = LoadBalancer(ids(3))
    assert lb.remove_servers(["s0", "zz"]) == {"s0"}
    assert lb.remove_servers("s1") == {"s1"}
    assert lb.servers() == ["s2"]


# ---- drain ------------------------------------------------------------------------------------
def test_drain_stops_new_requests_keeps_counting_then_drops():
    lb = LoadBalancer(["a", "b"])
    leases = [lb.acquire(f"r{i}") for i in range(4)]
    on_a = [x for x in leases if x.server_id == "a"]
    assert lb.remove_servers(["a"], drain=True) == {"a"}
    st = lb.status()
    assert st["draining"] == ["a"] and st["active"] == ["b"]
    assert lb.servers() == ["b"]
    assert all(lb.acquire(f"n{i}").server_id == "b" for i in range(5))
    assert lb.acquire(on_a[0].request_id).server_id == "b"  # its sticky session moved
    assert lb.release(on_a[0]) is True
    assert lb.inflight("a") == 1 and "a" in lb.status()["servers"]
    assert lb.release(on_a[1]) is True
    assert "a" not in lb.status()["servers"] and lb.status()["draining"] == []


def test_sticky_sessions_leave_a_draining_server():
    lb = LoadBalancer(["a", "b"])
    first = lb.acquire("session")
    lb.remove_servers([first.server_id], drain=True)
    assert lb.acquire("session").server_id != first.server_id


def test_draining_an_idle_server_drops_it_at_once():
    lb = LoadBalancer(["a", "b"])
    assert lb.remove_servers(["a"], drain=True) == {"a"}
    assert lb.status()["servers"] == {"b": 0}


def test_readding_a_draining_server_reactivates_it_with_its_count():
    lb = LoadBalancer(["a"])
    lease = lb.acquire("r")
    lb.remove_servers(["a"], drain=True)
    lb.add_servers(["a"])
    assert lb.servers() == ["a"] and lb.inflight("a") == 1
    assert lb.release(lease) is True and lb.inflight("a") == 0


def test_all_draining_raises():
    lb = LoadBalancer(["a"])
    lb.acquire("r")
    lb.remove_servers(["a"], drain=True)
    with pytest.raises(NoServerAvailable, match="draining or unhealthy"):
        lb.acquire("r2")


# ---- health -----------------------------------------------------------------------------------
def test_unhealthy_gets_nothing_new_and_releases_normally():
    lb = LoadBalancer(["a", "b"])
    session = lb.acquire("session")
    bad = session.server_id
    good = ({"a", "b"} - {bad}).pop()
    assert lb.mark_unhealthy(bad) is True
    assert lb.status()["unhealthy"] == [bad] and lb.servers() == [good]
    assert lb.acquire("session").server_id == good  # the sticky session moved
    assert all(lb.acquire(f"x{i}").server_id == good for i in range(4))
    assert lb.release(session) is True and lb.inflight(bad) == 0
    assert lb.mark_healthy(bad) is True
    assert lb.acquire("fresh").server_id == bad  # least loaded again
    assert lb.mark_unhealthy("nope") is False and lb.mark_healthy("nope") is False


# ---- sticky sessions --------------------------------------------------------------------------
def test_sticky_same_request_same_server_even_when_loaded():
    lb = LoadBalancer(ids(4))
    first = lb.acquire("conv")
    for i in range(3):
        lb.acquire(f"other{i}")
    assert lb.acquire("conv").server_id == first.server_id


def test_sticky_map_is_an_lru_of_bounded_size():
    lb = LoadBalancer(ids(4), sticky_capacity=2)
    a = lb.acquire("a").server_id
    lb.acquire("b")
    lb.acquire("a")  # refresh "a"
    lb.acquire("c")  # evicts "b"
    assert lb.clear_sticky() == 2
    assert lb.clear_sticky() == 0
    lb2 = LoadBalancer(ids(4), sticky_capacity=2)
    assert lb2.acquire("a").server_id == a


def test_sticky_capacity_zero_disables_stickiness():
    lb = LoadBalancer(ids(2), sticky_capacity=0)
    picks = {lb.acquire("same").server_id for _ in range(2)}
    assert picks == {"s0", "s1"}
    assert lb.clear_sticky() == 0


@pytest.mark.parametrize(("limit", "moves"), [(2, True), (None, False)])
def test_sticky_sessions_can_leave_an_overloaded_server(limit, moves):
    lb = LoadBalancer(ids(2), sticky_max_imbalance=limit)
    home = lb.acquire("conv").server_id
    other = ({"s0", "s1"} - {home}).pop()
    lb.mark_unhealthy(other)
    for i in range(4):
        lb.acquire(f"pile{i}")  # all on home: 5 vs 0
    lb.mark_healthy(other)
    assert (lb.acquire("conv").server_id == other) is moves
    if moves:
        assert lb.acquire("conv").server_id == other  # remapped: it stays there now


@pytest.mark.parametrize("bad", [-1, 1.5])
def test_bad_sticky_max_imbalance(bad):
    with pytest.raises(ValueError, match="sticky_max_imbalance"):
        LoadBalancer(["a"], sticky_max_imbalance=bad)


# ---- capacity ---------------------------------------------------------------------------------
def test_max_inflight_caps_each_server():
    lb = LoadBalancer(["a", "b"], max_inflight=2)
    held = [lb.acquire(f"r{i}") for i in range(4)]
    with pytest.raises(NoServerAvailable, match="max_inflight=2"):
        lb.acquire("r4")
    with pytest.raises(NoServerAvailable):
        lb.acquire("r0")  # sticky, but its server is full and so is every other
    lb.release(held[0])
    assert lb.acquire("r5").server_id == held[0].server_id


# ---- listeners ----------------------------------------------------------------------------------
def test_listeners_hear_adds_health_and_releases():
    lb = LoadBalancer(["a"])
    calls = []
    lb.add_listener(calls.append)
    lease = lb.acquire("r")
    assert calls == []
    lb.release(lease)
    lb.release(lease)  # a repeat frees nothing
    lb.add_servers(["b"])
    lb.mark_unhealthy("b")
    lb.mark_healthy("b")
    assert calls == ["released", "added", "healthy"]
    lb.remove_listener(calls.append)
    lb.release(lb.acquire("r"))
    assert len(calls) == 3


def test_status_shape():
    lb = LoadBalancer(ids(3))
    lb.acquire("r")
    lb.mark_unhealthy("s2")
    st = lb.status()
    assert set(st) == {"servers", "total_inflight", "active", "draining", "unhealthy"}
    assert st["total_inflight"] == 1 and st["active"] == ["s0", "s1"]

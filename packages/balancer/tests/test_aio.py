"""AsyncLoadBalancer: waits without polling, wakes on add / healthy / release, times out."""

import asyncio
import threading

import pytest

from offbeat.balancer import LoadBalancer, NoServerAvailable
from offbeat.balancer.aio import AsyncLoadBalancer


async def parked(alb, n=1):
    """Let the event loop run until `n` acquires are parked."""
    for _ in range(100):
        if alb.waiting >= n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"expected {n} parked acquires, got {alb.waiting}")


async def test_acquire_without_waiting_when_a_server_is_free():
    alb = AsyncLoadBalancer(["a", "b"])
    lease = await alb.acquire("r")
    assert lease.server_id in {"a", "b"} and alb.inflight(lease.server_id) == 1
    assert alb.release(lease) is True and alb.release(lease) is False


async def test_waits_for_a_server_to_be_added_without_polling():
    alb = AsyncLoadBalancer()
    calls = 0
    real = alb.balancer.acquire

    def counting(*a, **k):
        nonlocal calls
        calls += 1
        return real(*a, **k)

    alb.balancer.acquire = counting
    task = asyncio.create_task(alb.acquire("r"))
    await parked(alb)
    before = calls
    for _ in range(50):
        await asyncio.sleep(0.001)
    assert calls == before  # parked on a future: nobody retries until woken
    alb.add_servers({"a": "handle"})
    lease = await task
    assert (lease.server_id, lease.handle) == ("a", "handle")
    assert alb.waiting == 0


async def test_wakes_when_a_server_becomes_healthy():
    alb = AsyncLoadBalancer(["a"])
    alb.mark_unhealthy("a")
    task = asyncio.create_task(alb.acquire("r"))
    await parked(alb)
    assert not task.done()
    alb.mark_healthy("a")
    assert (await task).server_id == "a"


async def test_wakes_on_released_capacity_in_fifo_order():
    alb = AsyncLoadBalancer(["a"], max_inflight=1)
    first = await alb.acquire("r0")
    tasks = [asyncio.create_task(alb.acquire(f"r{i}")) for i in range(1, 4)]
    await parked(alb, 3)
    order = []
    lease = first
    for _ in range(3):
        alb.release(lease)
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        (t,) = done
        tasks.remove(t)
        lease = t.result()
        order.append(lease.request_id)
        assert alb.inflight("a") == 1
    assert order == ["r1", "r2", "r3"]


async def test_timeout_raises_no_server_available():
    alb = AsyncLoadBalancer()
    with pytest.raises(NoServerAvailable, match=r"No available servers.*waited 0.02s"):
        await alb.acquire("r", timeout=0.02)
    assert alb.waiting == 0
    with pytest.raises(NoServerAvailable):
        await alb.acquire("r", timeout=0)


async def test_wake_from_another_thread():
    alb = AsyncLoadBalancer()
    task = asyncio.create_task(alb.acquire("r", timeout=30))
    await parked(alb)
    t = threading.Thread(target=alb.balancer.add_servers, args=(["x"],))
    t.start()
    lease = await task
    t.join()
    assert lease.server_id == "x"


async def test_release_from_another_thread_wakes_a_waiter():
    alb = AsyncLoadBalancer(["a"], max_inflight=1)
    held = await alb.acquire("r0")
    task = asyncio.create_task(alb.acquire("r1", timeout=30))
    await parked(alb)
    t = threading.Thread(target=alb.balancer.release, args=(held,))
    t.start()
    assert (await task).request_id == "r1"
    t.join()


async def test_a_cancelled_waiter_passes_its_wake_up_on():
    alb = AsyncLoadBalancer(["a"], max_inflight=1)
    held = await alb.acquire("r0")
    t1 = asyncio.create_task(alb.acquire("r1"))
    await parked(alb, 1)
    t2 = asyncio.create_task(alb.acquire("r2"))
    await parked(alb, 2)
    alb.release(held)  # wakes t1 (the longest waiter) ...
    t1.cancel()  # ... which leaves before it runs: t2 must get the slot
    lease = await asyncio.wait_for(t2, 5)
    assert lease.request_id == "r2"
    with pytest.raises(asyncio.CancelledError):
        await t1
    assert alb.status()["total_inflight"] == 1


async def test_adding_servers_wakes_every_waiter():
    alb = AsyncLoadBalancer(max_inflight=1)
    tasks = [asyncio.create_task(alb.acquire(f"r{i}")) for i in range(4)]
    await parked(alb, 4)
    alb.add_servers(["a", "b", "c", "d"])
    leases = await asyncio.gather(*tasks)
    assert sorted(x.server_id for x in leases) == ["a", "b", "c", "d"]


async def test_many_waiters_all_served_as_capacity_frees():
    alb = AsyncLoadBalancer(["a", "b"], max_inflight=2)

    async def job(i):
        async with alb.lease(f"r{i}") as lease:
            assert alb.inflight(lease.server_id) <= 2
            await asyncio.sleep(0)
        return lease

    leases = await asyncio.gather(*(job(i) for i in range(40)))
    assert len(leases) == 40 and all(x.released for x in leases)
    assert alb.status()["total_inflight"] == 0 and alb.waiting == 0


async def test_cost_above_the_cap_can_never_fit():
    alb = AsyncLoadBalancer(["a"], max_inflight=2)
    with pytest.raises(ValueError, match="max_inflight=2"):
        await alb.acquire("r", cost=3)


async def test_wraps_an_existing_balancer():
    lb = LoadBalancer(["a"])
    alb = AsyncLoadBalancer(balancer=lb)
    lease = await alb.acquire("r")
    assert lb.inflight("a") == 1
    lb.release(lease)
    with pytest.raises(TypeError, match="not both"):
        AsyncLoadBalancer(["a"], balancer=lb)

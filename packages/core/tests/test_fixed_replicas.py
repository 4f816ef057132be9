"""Replicas at fixed weights (OPD teachers, GenRM judges): a replica a call failed on is
probed; a dead one is removed and replaced, and the replacement serves at once; one that
answers stays; the starts are bounded."""

from __future__ import annotations

import asyncio

import pytest

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.core.trainer import fixed_replicas as fixed_module
from offbeat.core.trainer.fixed_replicas import FixedReplicas
from offbeat.core.trainer.replicas import Replacement


class Replica:
    def __init__(self, name: str, dead: bool = False) -> None:
        self.name, self.dead, self.probes = name, dead, 0

    async def refresh(self) -> int:
        self.probes += 1
        await asyncio.sleep(0)
        if self.dead:
            raise ConnectionError(f"{self.name} is gone")
        return 0


class Starts:
    """A `Replacement.start`: fails `failures` times, then starts a Replica after `delay_s`."""

    def __init__(self, failures: int = 0, delay_s: float = 0.0) -> None:
        self.failures, self.delay_s = failures, delay_s
        self.calls: list[tuple[str, str, object]] = []

    async def __call__(self, dead_id, new_id, dead):
        self.calls.append((dead_id, new_id, dead))
        await asyncio.sleep(self.delay_s)
        if len(self.calls) <= self.failures:
            raise RuntimeError(f"no room for {new_id}")
        return Replica(new_id)


@pytest.fixture
def backoffs(monkeypatch):
    asked: list[float] = []
    real = asyncio.sleep

    async def fake(delay, *a, **k):
        if delay >= 1:  # the backoff (the fakes' own short sleeps stay real)
            asked.append(delay)
            delay = 0
        await real(delay)

    monkeypatch.setattr(fixed_module.asyncio, "sleep", fake)
    return asked


async def test_a_dead_replica_is_probed_once_removed_and_its_replacement_serves_at_once():
    a = Replica("t-0", dead=True)
    balancer = AsyncLoadBalancer({"t-0": a})
    starts = Starts(delay_s=0.05)
    r = FixedReplicas({"t-0": a}, balancer, replacement=Replacement(starts, 3, 1.0))
    # three calls failed on it at once: one probe, one removal, one replacement
    out = await asyncio.gather(*(r.failed("t-0", ConnectionError("boom")) for _ in range(3)))
    assert out == [True] * 3 and a.probes == 1  # True: a retry will be served
    assert "ConnectionError: boom" in r.removed["t-0"] and "health check" in r.removed["t-0"]
    assert balancer.servers() == [] and list(r.replacing) == ["t-0"]
    # a retry waits in the balancer and gets the replacement: no weight sync to wait for
    lease = await asyncio.wait_for(balancer.acquire("retry", timeout=5), 5)
    assert lease.server_id == "t-0-r1"
    assert starts.calls == [("t-0", "t-0-r1", a)]  # the dead one handed over to be freed
    assert r.replaced == {"t-0": "t-0-r1"} and list(r.servers) == ["t-0-r1"]
    assert list(r.started) == ["t-0-r1"] and r.replacing == {}


async def test_a_replica_that_answers_its_probe_stays():
    a = Replica("t-0")
    balancer = AsyncLoadBalancer({"t-0": a})
    starts = Starts()
    r = FixedReplicas({"t-0": a}, balancer, replacement=Replacement(starts, 3, 1.0))
    assert await r.failed("t-0", ValueError("a bad request")) is True
    assert a.probes == 1 and r.removed == {} and balancer.servers() == ["t-0"]
    assert starts.calls == []
    # unknown or already removed ids, and a failure before any lease, probe nothing
    assert await r.failed(None, TimeoutError()) is True and await r.failed("t-9") is True
    assert a.probes == 1


async def test_a_stopped_replica_fails_its_probe_by_the_health_timeout():
    class Stopped(Replica):
        async def refresh(self):
            await asyncio.sleep(3600)

    a = Stopped("t-0")
    balancer = AsyncLoadBalancer({"t-0": a})
    r = FixedReplicas({"t-0": a}, balancer, health_timeout_s=0.05)
    assert await r.failed("t-0", TimeoutError("call")) is False  # nothing replaces it
    assert "TimeoutError" in r.removed["t-0"] and balancer.servers() == []
    assert await r.wait_available() is False


async def test_replacement_starts_are_bounded_with_doubling_backoff_then_given_up(backoffs):
    a = Replica("t-0", dead=True)
    balancer = AsyncLoadBalancer({"t-0": a})
    starts = Starts(failures=5)
    r = FixedReplicas({"t-0": a}, balancer, replacement=Replacement(starts, 3, 2.0))
    assert await r.failed("t-0", ConnectionError()) is True  # one is on its way
    assert await asyncio.wait_for(r.wait_available(), 5) is False
    assert [c[1] for c in starts.calls] == ["t-0-r1", "t-0-r2", "t-0-r3"]
    assert [c[2] for c in starts.calls] == [a, None, None]  # freed by the first start
    assert backoffs == [2.0, 4.0]
    assert "no room for t-0-r3" in r.gave_up["t-0"] and not r.available
    assert r.summary()["gave_up"] == r.gave_up


async def test_a_second_start_succeeds_and_a_waiter_is_woken():
    a = Replica("t-0", dead=True)
    balancer = AsyncLoadBalancer({"t-0": a})
    starts = Starts(failures=1)
    r = FixedReplicas({"t-0": a}, balancer, replacement=Replacement(starts, 3, 0.0))
    await r.failed("t-0", ConnectionError())
    assert await asyncio.wait_for(r.wait_available(), 5) is True
    assert r.replaced == {"t-0": "t-0-r2"} and balancer.servers() == ["t-0-r2"]
    # the replacement dies too: replaced again, under the next generation's name
    r.servers["t-0-r2"].dead = True
    await r.failed("t-0-r2", ConnectionError())
    assert await asyncio.wait_for(r.wait_available(), 5) is True
    assert r.replaced == {"t-0": "t-0-r2", "t-0-r2": "t-0-r3"}
    await r.close()


async def test_after_close_a_failure_starts_nothing():
    """The run shuts its replicas down and calls fail on them: no replacement then."""
    a, b = Replica("t-0", dead=True), Replica("t-1", dead=True)
    balancer = AsyncLoadBalancer({"t-0": a, "t-1": b})
    starts = Starts(delay_s=10)
    r = FixedReplicas({"t-0": a, "t-1": b}, balancer, replacement=Replacement(starts, 3, 0.0))
    await r.failed("t-0", ConnectionError("killed"))  # its replacement is on its way
    await r.failed("t-1", ConnectionError("killed"))
    assert set(r.replacing) == {"t-0", "t-1"}
    waiter = asyncio.ensure_future(r.wait_available())
    await asyncio.sleep(0)
    await r.close()  # the start in progress is cancelled, the waiter told
    assert await asyncio.wait_for(waiter, 1) is False and r.replacing == {}
    c = Replica("t-2", dead=True)
    r.servers["t-2"] = c
    assert await r.failed("t-2", ConnectionError("shut down")) is False
    assert c.probes == 0 and "t-2" not in r.removed and len(starts.calls) == 2

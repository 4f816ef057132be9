"""Admission of calls into the engine: FIFO, bounded, closed during a pause, weights."""

from __future__ import annotations

import asyncio

import pytest

from offbeat.rollout_vllm._admission import Admission

pytestmark = pytest.mark.asyncio


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_at_most_limit_inside_and_fifo():
    adm = Admission(2)
    order: list[int] = []

    async def call(i: int, hold: asyncio.Event) -> None:
        await adm.enter()
        order.append(i)
        await hold.wait()
        adm.leave()

    holds = [asyncio.Event() for _ in range(5)]
    tasks = [asyncio.create_task(call(i, holds[i])) for i in range(5)]
    await settle()
    assert adm.inside == 2 and adm.waiting == 3 and order == [0, 1]
    holds[1].set()
    await settle()
    assert order == [0, 1, 2] and adm.inside == 2
    for h in holds:
        h.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4] and adm.inside == 0


async def test_closed_admits_nothing_until_reopened():
    adm = Admission(None)
    adm.close()
    t = asyncio.create_task(adm.enter())
    await settle()
    assert not t.done() and adm.waiting == 1
    adm.reopen()
    await settle()
    assert t.done() and adm.inside == 1


async def test_wait_empty_waits_for_the_last_one_inside():
    adm = Admission(4)
    await adm.enter()
    await adm.enter()
    w = asyncio.create_task(adm.wait_empty())
    adm.leave()
    await settle()
    assert not w.done()
    adm.leave()
    await settle()
    assert w.done()


async def test_weights_count_and_a_heavy_request_blocks_the_ones_behind():
    adm = Admission(8)
    await adm.enter(6)
    heavy = asyncio.create_task(adm.enter(4))  # 6 + 4 > 8: waits
    light = asyncio.create_task(adm.enter(1))  # would fit, but FIFO keeps it behind
    await settle()
    assert not heavy.done() and not light.done()
    adm.leave(6)
    await settle()
    assert heavy.done() and light.done() and adm.inside == 5


async def test_a_request_heavier_than_the_limit_goes_in_alone():
    adm = Admission(4)
    await adm.enter(10)
    assert adm.inside == 10
    t = asyncio.create_task(adm.enter(1))
    await settle()
    assert not t.done()
    adm.leave(10)
    await settle()
    assert t.done()


async def test_a_cancelled_waiter_is_skipped():
    adm = Admission(1)
    await adm.enter()
    a = asyncio.create_task(adm.enter())
    b = asyncio.create_task(adm.enter())
    await settle()
    a.cancel()
    await settle()
    adm.leave()
    await settle()
    assert b.done() and adm.inside == 1 and adm.waiting == 0


async def test_bad_limits_and_weights_are_refused():
    with pytest.raises(ValueError, match="limit"):
        Admission(0)
    with pytest.raises(ValueError, match="weight"):
        await Admission(2).enter(0)


async def test_evict_sends_the_waiting_calls_away_and_keeps_the_ones_inside():
    from offbeat.rollout_vllm._admission import Evicted

    gate = Admission(limit=1)
    await gate.enter()  # inside
    waiting = [asyncio.ensure_future(gate.enter()) for _ in range(3)]
    await asyncio.sleep(0)
    gate.close()
    assert gate.evict() == 3
    for w in waiting:
        with pytest.raises(Evicted):
            await w
    assert gate.inside == 1 and gate.waiting == 0
    gate.leave()
    gate.reopen()
    await asyncio.wait_for(gate.enter(), 1)  # the gate works again
    assert gate.inside == 1

"""Replay buffer rules: lifecycle, oldest-first batches, drop/wait staleness, refills,
failures, checkpoint round trip."""

from __future__ import annotations

import asyncio

import pytest

from offbeat.core.buffer import (
    AsyncReplayBuffer,
    BufferConfig,
    GroupStatus,
    ReplayBuffer,
)
from offbeat.core.data import Trajectory


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """The buffer's core never needs Ray: make ray.init fail if anything calls it."""
    ray = pytest.importorskip("ray")

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init called by a buffer unit test")

    monkeypatch.setattr(ray, "init", refuse)


def traj(version: int = 0, reward: float = 1.0) -> Trajectory:
    return Trajectory([1, 2], [3], [-0.5], reward, version, version)


def buf(b=2, threshold=3, strategy="drop", warmup=1) -> ReplayBuffer:
    return ReplayBuffer(BufferConfig(b, threshold, strategy, warmup))


def fill(rb: ReplayBuffer) -> list[str]:
    return [g.uid for g in rb.submit([{"i": i} for i in range(rb.free_slots())])]


def finish_all(rb: ReplayBuffer, version: int = 0) -> None:
    for g in rb.take_pending():
        rb.finish(g.uid, [traj(version)])


def test_lifecycle_and_oldest_first():
    rb = buf(b=2, warmup=1)
    assert rb.free_slots() == 4
    uids = fill(rb)
    assert rb.counts()["pending"] == 4 and rb.free_slots() == 0
    running = rb.take_pending(3)
    assert [g.uid for g in running] == uids[:3]
    assert all(g.status is GroupStatus.RUNNING for g in running)
    # finish out of order: batches still come oldest first among the finished
    rb.finish(uids[2], [traj()])
    rb.finish(uids[0], [traj()])
    batch = rb.sample(2)
    assert [g.uid for g in batch] == [uids[0], uids[2]]
    assert rb.counts() == {
        "submitted": 4, "trained": 2, "evicted": 0, "failed": 0,
        "pending": 1, "running": 1, "finished": 0,
    }  # fmt: skip
    rb.check_accounting()


def test_admission_depth_counts_groups_taken_this_step():
    rb = buf(b=2, warmup=1)
    fill(rb)
    finish_all(rb)
    rb.sample(2)
    assert rb.free_slots() == 0  # step 1's batch is gone, step 2's still in flight
    rb.begin_step(2)
    assert rb.free_slots() == 2  # one new batch for step 3... trained at span <= 2
    new = rb.submit([{"x": 1}, {"x": 2}])
    assert all(g.submission_step == 2 for g in new)


def test_drop_evicts_stale_finished_and_refills_exactly_as_many():
    rb = buf(b=2, threshold=2, strategy="drop", warmup=1)
    old = fill(rb)  # submitted at step 1
    rb.take_pending()
    rb.finish(old[0], [traj()])
    rb.finish(old[1], [traj()])
    rb.sample(2)
    rb.begin_step(2)
    fill(rb)
    rb.begin_step(3)  # old[2], old[3] are unfinished with span 3
    assert rb.evict_stale() == []  # unfinished groups are never evicted
    rb.finish(old[2], [traj()])
    slots_before = rb.free_slots()
    stale = rb.evict_stale()
    assert [g.uid for g in stale] == [old[2]]
    assert rb.free_slots() == slots_before + 1
    assert rb.counts()["evicted"] == 1 and rb.ledger()[old[2]] == "evicted"
    rb.check_accounting()


def test_drop_never_trains_span_above_threshold():
    rb = buf(b=1, threshold=1, strategy="drop", warmup=0)
    fill(rb)
    (g,) = rb.take_pending()
    rb.begin_step(2)
    rb.finish(g.uid, [traj()])
    assert len(rb.evict_stale()) == 1
    assert not rb.ready(1)


def test_wait_blocks_while_unfinished_group_reached_threshold():
    rb = buf(b=1, threshold=2, strategy="wait", warmup=1)
    a, b = fill(rb)
    rb.take_pending()
    rb.finish(b, [traj()])
    assert rb.ready(1)  # a has span 1 < 2
    rb.begin_step(2)  # nothing trained at step 1 in this toy; a now has span 2
    assert [g.uid for g in rb.blocked_by()] == [a]
    assert not rb.ready(1)
    with pytest.raises(RuntimeError, match="blocked"):
        rb.sample(1)
    rb.finish(a, [traj()])
    assert [g.uid for g in rb.sample(1)] == [a]  # the straggler goes first


def test_wait_threshold_one_is_on_policy():
    rb = buf(b=2, threshold=1, strategy="wait", warmup=3)
    for step in range(1, 5):
        rb.begin_step(step)
        assert rb.free_slots() == 2  # never more than this step's batch
        fill(rb)
        finish_all(rb)
        batch = rb.sample(2)
        assert all(g.span(step) == 1 for g in batch)
        assert rb.free_slots() == 0


def test_failed_groups_are_evicted_counted_and_refilled():
    rb = buf(b=2, warmup=0)
    uids = fill(rb)
    rb.take_pending()
    rb.fail(uids[0], "reward raised ZeroDivisionError")
    assert rb.free_slots() == 1
    assert rb.counts()["failed"] == 1 and rb.ledger()[uids[0]] == "failed"
    with pytest.raises(KeyError, match="failed"):
        rb.finish(uids[0], [traj()])
    fill(rb)
    rb.check_accounting()


def test_misuse_is_refused_with_clear_errors():
    rb = buf(b=1, warmup=0)
    with pytest.raises(ValueError, match="free slots"):
        rb.submit([{}, {}])
    (uid,) = fill(rb)
    with pytest.raises(ValueError, match="pending"):
        rb.finish(uid, [traj()])  # not running yet
    rb.begin_step(3)
    with pytest.raises(ValueError, match="already at step 3"):
        rb.begin_step(2)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"groups_per_step": 0}, "groups_per_step"),
        ({"max_off_policy_threshold": 0}, "max_off_policy_threshold"),
        ({"max_off_policy_strategy": "skip"}, "max_off_policy_strategy"),
        ({"num_warmup_batches": -1}, "num_warmup_batches"),
        ({"num_warmup_batches": 2, "max_off_policy_threshold": 2}, "num_warmup_batches"),
    ],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        BufferConfig(**{"groups_per_step": 2, **kwargs})


def test_state_dict_keeps_finished_and_reissues_unfinished():
    rb = buf(b=2, warmup=1)
    uids = fill(rb)
    rb.take_pending(2)
    rb.finish(uids[0], [traj(version=0)])
    state = rb.state_dict()
    restored = ReplayBuffer(rb.config)
    restored.load_state_dict(state)
    c = restored.counts()
    assert (c["finished"], c["pending"], c["running"]) == (1, 3, 0)
    assert restored.free_slots() == rb.free_slots()
    restored.check_accounting()
    # the re-issued prompts run again and the ids stay unique
    finish_all(restored, version=1)
    new = fill(restored) if restored.free_slots() else []
    assert not set(new) & set(uids)
    assert [g.uid for g in restored.sample(2)] == uids[:2]


async def test_async_sample_waits_and_wakes_on_finish():
    ab = AsyncReplayBuffer(BufferConfig(1, 2, "drop", 0))
    (g,) = await ab.submit([{"q": 1}])
    waiter = asyncio.create_task(ab.sample(1))
    await asyncio.sleep(0)
    assert not waiter.done()
    (taken,) = await ab.take_pending()
    await ab.finish(taken.uid, [traj()])
    batch, evicted = await asyncio.wait_for(waiter, 5)
    assert [x.uid for x in batch] == [g.uid] and evicted == []


async def test_async_sample_reports_evictions_and_frees_slots():
    ab = AsyncReplayBuffer(BufferConfig(1, 1, "drop", 0))
    await ab.submit([{"q": 1}])
    (g,) = await ab.take_pending()
    await ab.begin_step(2)
    await ab.finish(g.uid, [traj()])  # span 2 > 1: stale
    waiter = asyncio.create_task(ab.sample(1))
    assert await asyncio.wait_for(ab.wait_for_slots(), 5) == 1
    await ab.submit([{"q": 2}])
    (h,) = await ab.take_pending()
    await ab.finish(h.uid, [traj(version=1)])
    batch, evicted = await asyncio.wait_for(waiter, 5)
    assert [x.uid for x in evicted] == [g.uid] and [x.uid for x in batch] == [h.uid]

"""A rollout that fails never hangs the run. Progress means groups that can be trained:
when a window of groups in a row all fail (reward errors, engine errors) the run stops
naming the data source and the first error, and the stall watchdog does not count failed
groups as progress. A mix of failed and finished groups keeps training."""

from __future__ import annotations

import asyncio
import itertools
import re

import pytest
from trainer_fakes import Harness, check_accounting

from offbeat.core.rewards import register_reward
from offbeat.core.tasks import make_rows
from offbeat.core.trainer import GroupFailed, RolloutDriver, RolloutFailing
from offbeat.core.trainer.watchdog import StallError

register_reward("my_source", lambda response, ground_truth, **_: 1.0)


def rows_of(source: str, n: int = 64) -> list[dict]:
    rows = make_rows("reverse", n, seed=3)
    for r in rows:
        r["data_source"] = source
    return rows


class FlakyAgent:
    """A fake agent loop: runs the real one, then fails the group when `fails(k)` holds for
    the k-th group to complete (so failures arrive in exactly that order), as an engine
    error would."""

    def __init__(self, inner, fails) -> None:
        self.inner, self.fails = inner, fails
        self.completed = itertools.count()

    async def sample(self, uid, row, n, sampling=None):
        out = await self.inner.sample(uid, row, n, sampling)
        k = next(self.completed)
        if self.fails(k):
            raise GroupFailed(f"generate({uid}-0) failed: ConnectionError: replica gone #{k}")
        return out


async def test_every_group_failing_stops_the_run_naming_source_and_first_error(tmp_path):
    calls = itertools.count()

    def broken(response, ground_truth, **_):
        raise ValueError(f"cannot parse answer #{next(calls)}")

    register_reward("always_broken", broken)
    h = Harness(tmp_path, rows=rows_of("always_broken"), max_failures=6)
    with pytest.raises(RolloutFailing) as info:
        await h.run()
    message = str(info.value)
    assert "6 prompt groups in a row failed" in message
    assert "data_source 'always_broken'" in message
    # the first exception of the window, not a later one
    assert "reward 'always_broken' raised ValueError: cannot parse answer #0" in message
    failed = h.buffer.core.counts()["failed"]
    assert 6 <= failed < 6 + h.driver.max_concurrent_groups  # workers stop at the limit
    assert h.engine.updates == 0 and h.trainer.trained_uids == []
    check_accounting(h)


async def test_engine_errors_in_every_group_stop_the_run(tmp_path):
    h = Harness(
        tmp_path, rows=rows_of("my_source"), max_failures=4,
        wrap_agent=lambda agent: FlakyAgent(agent, lambda k: True),
    )  # fmt: skip
    with pytest.raises(RolloutFailing, match=r"data_source 'my_source'.*replica gone #0$"):
        await h.run()
    assert h.trainer.trained_uids == []


async def test_a_mix_of_failed_and_finished_groups_keeps_running(tmp_path):
    # Two of every three groups fail, never three in a row: under a window of 3 the run
    # trains to the end, and every failed group was refilled.
    h = Harness(
        tmp_path, rows=rows_of("my_source", 128), max_failures=3,
        wrap_agent=lambda agent: FlakyAgent(agent, lambda k: k % 3 != 2),
    )  # fmt: skip
    summary = await h.run()
    assert summary["steps"] == 3 and h.engine.updates == 6
    c = h.buffer.core.counts()
    assert c["failed"] >= 2 * c["trained"] - 2  # most groups failed, yet it kept going
    assert h.driver.groups_failed == c["failed"]
    check_accounting(h)


async def test_stall_watchdog_counts_no_failed_group_as_progress(tmp_path):
    # No failure limit: only the watchdog can stop this run, while groups keep failing
    # (and being refilled) the whole time.
    register_reward("also_broken", lambda response, ground_truth, **_: 1 / 0)
    h = Harness(tmp_path, rows=rows_of("also_broken"), stall_timeout_s=0.5)
    with pytest.raises(StallError, match=r"nothing advanced") as info:
        await asyncio.wait_for(h.trainer.run(), 30)
    message = str(info.value)
    assert "trainer.stall_timeout_s=0.5" in message
    assert info.value.stage == "reward"  # failing since its first call, never a success
    assert re.search(r"the stalled stage is reward: \d in flight; .*0 done, \d+ failed", message)
    assert "data_source 'also_broken'" in message and "ZeroDivisionError" in message
    assert h.buffer.core.counts()["failed"] >= 2  # failures happened, and did not count


def test_failure_limit_is_checked():
    with pytest.raises(ValueError, match="max_consecutive_failures=0"):
        RolloutDriver(None, None, None, n=1, max_concurrent_groups=1, max_consecutive_failures=0)

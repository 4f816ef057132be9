"""The progress registry and the stall watchdog: the registry's accounting (threads,
tasks, failures, cancellations), the watchdog's rule on a fake clock (what keeps a run
live, what holds it, which stage it names), and the real training loop on fakes: a
reward that hangs, an update that never returns, a coroutine that blocks the event loop
are each named within the timeout, with the stacks in the run's log directory; a
checkpoint save longer than the timeout does not trip it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import threading
import time

import pytest
from trainer_fakes import FakeEngine, FakeServer, Harness

from offbeat.core import progress
from offbeat.core.progress import Progress
from offbeat.core.rewards import register_reward
from offbeat.core.runtime import TrainerGroup
from offbeat.core.tasks import make_rows
from offbeat.core.trainer.replicas import Replacement
from offbeat.core.trainer.watchdog import (
    StallError,
    StallWatchdog,
    stall_report,
    stalled_stage,
    trainer_actors,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ---- the registry -------------------------------------------------------------------------
def test_working_counts_a_success_a_failure_and_neither_for_a_cancel():
    p = Progress()
    token = progress.activate(p)
    try:
        with progress.working("reward"):
            pass
        with pytest.raises(ZeroDivisionError), progress.working("reward"):
            raise ZeroDivisionError("division by zero")

        async def cancelled():
            with progress.working("reward"):
                await asyncio.Event().wait()

        async def main():
            task = asyncio.create_task(cancelled())
            await asyncio.sleep(0)
            assert p.snapshot().stages[0].in_flight == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
    finally:
        progress.deactivate(token)
    (s,) = p.snapshot().stages
    assert (s.done, s.failed, s.in_flight) == (1, 1, 0)
    assert s.last_error == "ZeroDivisionError: division by zero"
    assert s.failing_since_s is not None  # failing since the failure: no success after it


def test_hooks_report_from_tasks_and_threads_below_activate_and_nothing_without():
    progress.advance("buffer")  # no registry active: nothing happens
    with progress.working("reward"), progress.exempt("save"), progress.phase("x"):
        pass
    p = Progress()

    async def main():
        token = progress.activate(p)
        try:
            await asyncio.gather(
                asyncio.create_task(_advance_in_task()),
                asyncio.to_thread(progress.advance, "generation", "r1"),
            )
        finally:
            progress.deactivate(token)
        progress.advance("buffer")  # after deactivate: not reported

    asyncio.run(main())
    assert {s.name: s.done for s in p.snapshot().stages} == {"buffer": 1, "generation[r1]": 1}


async def _advance_in_task() -> None:
    progress.advance("buffer")


def test_concurrent_reports_from_many_threads_lose_nothing():
    p = Progress()
    n_threads, n_ops = 8, 2000

    def work(i: int) -> None:
        token = progress.activate(p)
        for k in range(n_ops):
            with progress.working("generation", f"r{i % 2}", f"req-{i}-{k}"):
                pass
            progress.advance("buffer")
            if k % 100 == 0:
                p.snapshot()  # readers meanwhile
        progress.deactivate(token)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stages = {s.name: s for s in p.snapshot().stages}
    assert stages["buffer"].done == n_threads * n_ops
    assert stages["generation[r0]"].done + stages["generation[r1]"].done == n_threads * n_ops
    assert all(s.in_flight == 0 and s.failed == 0 for s in stages.values())


def test_the_phase_is_the_latest_one_still_open():
    p = Progress()
    token = progress.activate(p)
    try:
        with progress.phase("step 3"):
            with progress.phase("step 3: waiting for a batch"):
                assert p.snapshot().phase == "step 3: waiting for a batch"
            assert p.snapshot().phase == "step 3"
        assert p.snapshot().phase == ""
    finally:
        progress.deactivate(token)


# ---- the watchdog's rule, on a fake clock ----------------------------------------------
def rig(timeout_s: float = 10.0) -> tuple[Clock, Progress, StallWatchdog]:
    clock = Clock()
    p = Progress(clock)
    w = StallWatchdog(timeout_s, dump_dir=".", registry=p, replicas=lambda: ["r0", "r1"])
    p.arm()
    return clock, p, w


def test_it_trips_only_after_the_timeout_with_nothing_live_and_names_the_stuck_replica():
    clock, p, w = rig()
    clock.t += 1
    p.advance("generation", "r1")
    ticket = p.begin("generation", "r0", "g7-1")  # never answers
    clock.t += 1
    p.advance("buffer")  # a group finished: the run is live at t0 + 2
    clock.t += 10.0
    assert w.check() is None  # exactly the timeout since: not yet
    clock.t += 0.5
    stage, report = w.check()
    assert stage == "generation[r0]"
    assert "nothing advanced for 10.5 s (trainer.stall_timeout_s=10)" in report
    assert (
        "the stalled stage is generation[r0]: 1 in flight; the oldest for 11.5 s (g7-1)" in report
    )
    assert "per replica: r0: 1 (no answer yet), r1: 0 (last answer 11.5 s ago)" in report
    assert "oldest pending request: 11.5 s (g7-1 on r0)" in report
    p.end(ticket)  # an answer is not live progress by itself
    assert w.check() is not None


def test_generation_answers_and_reward_calls_alone_do_not_keep_it_live():
    clock, p, w = rig()
    for _ in range(30):  # every group fails after its generation and reward calls
        clock.t += 1
        p.advance("generation", "r0")
        p.fail("reward", error="ZeroDivisionError: division by zero")
        p.fail("buffer", error="group failed")
    stage, report = w.check()
    assert stage == "reward"  # failing since its first call
    assert "reward: 0 in flight; 0 done, 30 failed" in report
    assert "failing for 29.0 s: ZeroDivisionError: division by zero" in report


@pytest.mark.parametrize("live", ["buffer", "validation", "old_log_prob", "update", "sync"])
def test_each_live_stage_keeps_it_live(live):
    clock, p, w = rig()
    for _ in range(30):
        clock.t += 1
        p.advance(live)
    assert w.check() is None


def test_an_exempt_phase_holds_it_and_its_end_restarts_the_count():
    clock, p, w = rig()
    ticket = p.begin_exempt("checkpoint save")
    clock.t += 100
    assert w.check() is None
    p.end_exempt(ticket)
    clock.t += 9
    assert w.check() is None
    clock.t += 2
    assert w.check()[0] == "submission"  # nothing in flight anywhere, no trainer phase
    ticket = p.push_phase("step 2")
    stage, report = w.check()
    assert stage == "trainer" and "the trainer is in none of its reported stages" in report
    p.pop_phase(ticket)
    ticket = p.push_phase("step 2: waiting for a batch of 4 prompt groups")
    assert w.check()[0] == "submission"


def test_the_stage_stuck_longest_is_named_and_ties_go_in_pipeline_order():
    clock, p, _ = rig()
    p.begin("update", None, "step 2, mini-batch 1/2")
    p.begin("reward", None, "data_source 'x'")  # same moment: reward comes first
    clock.t += 1
    p.begin("generation", "r0", "g1")
    clock.t += 20
    stage = stalled_stage(p.snapshot())
    assert stage.name == "reward"
    _, report = stall_report(p.snapshot(), 10.0)
    assert "trainer phase: in update (step 2, mini-batch 1/2)" in report


def test_off_or_unarmed_it_never_trips():
    clock, p, w = rig()
    p.disarm()
    clock.t += 1000
    assert w.check() is None
    for off in (None, 0):
        assert not StallWatchdog(off, dump_dir=".").enabled


# ---- the other processes' stacks ------------------------------------------------------
def test_a_trip_appends_each_actors_stacks_and_names_the_silent_ones(tmp_path):
    asked: list[float] = []

    def remote_stacks(timeout_s: float) -> dict[str, str]:
        asked.append(timeout_s)
        return {
            "trainer rank 0": "pid 11: ray::TrainerRank\n  File 'rank.py', in update\n",
            "replica rollout-0": "(did not answer within 3 s)",
        }

    clock = Clock()
    p = Progress(clock)
    w = StallWatchdog(4.0, dump_dir=tmp_path, registry=p, remote_stacks=remote_stacks)
    p.arm()
    clock.t += 5
    stage, report = w.check()
    w._trip(stage, report)  # no loop armed: only the dump and the log
    assert asked == [w.remote_timeout_s] and 2.0 <= w.remote_timeout_s <= 10.0
    (dump,) = tmp_path.glob("stall-*.txt")
    text = dump.read_text()
    assert text.startswith("stall: nothing advanced")
    own = text.index("--- thread MainThread")  # this process's first, then each actor's
    rank = text.index("=== actor trainer rank 0\npid 11: ray::TrainerRank")
    assert own < rank < text.index("=== actor replica rollout-0\n(did not answer within 3 s)")
    assert w._actor_stacks(dump) == (
        "stacks of trainer rank 0 in the same file; none from replica rollout-0 "
        "(did not answer within 3 s)"
    )


def test_actors_that_fail_to_answer_do_not_keep_the_stop_from_the_run(tmp_path):
    def broken(timeout_s: float) -> dict[str, str]:
        raise ConnectionError("the cluster is gone")

    w = StallWatchdog(4.0, dump_dir=tmp_path, remote_stacks=broken)
    line = w._actor_stacks(tmp_path / "x.txt")
    assert line == "(the actors' stacks failed: ConnectionError: the cluster is gone)"


class _Handle:
    def __init__(self, has: bool) -> None:
        self.has = has

    def __getattr__(self, name):
        if name == "format_stacks" and self.has:
            return object()
        raise AttributeError(name)


def test_trainer_actors_are_its_ranks_the_separate_critic_and_reference_ranks_and_replicas():
    from types import SimpleNamespace as NS

    r0, r1, a, b, g, hy = (_Handle(True), _Handle(True), _Handle(True), _Handle(False),
                           _Handle(True), _Handle(True))  # fmt: skip
    c0, f0 = _Handle(True), _Handle(True)
    critic, ref = NS(roles=("critic",), handles=[c0]), NS(roles=("reference",), handles=[f0])
    trainer = NS(
        engine=NS(handles=[r0, r1], linked=[critic, ref]),  # critic/ref.placement=separate
        pool=NS(servers={"rollout-0": NS(handle=a), "sglang-0": NS(handle=b),
                         "local": object()}, guests={"guest-0": NS(handle=g)}),
        hybrid=NS(servers={"hybrid-0": NS(handle=hy)}),
    )  # fmt: skip
    assert trainer_actors(trainer) == {
        "trainer rank 0": r0, "trainer rank 1": r1, "critic rank 0": c0, "reference rank 0": f0,
        "replica rollout-0": a,
        "replica guest-0": g, "replica hybrid-0": hy,
    }  # fmt: skip
    group = TrainerGroup.around(FakeEngine())  # the trainer in the driver
    local = NS(engine=group, pool=NS(servers={"s0": object()}, guests={}), hybrid=None)
    assert trainer_actors(local) == {}  # its rank is this process, fake replicas
    group.shutdown()


# ---- the training loop on fakes ---------------------------------------------------------
def rows_of(source: str, n: int = 64) -> list[dict]:
    rows = make_rows("reverse", n, seed=0)
    for r in rows:
        r["data_source"] = source
    return rows


STALL_S = 2.0  # seconds: short, yet far above any gap of these fakes on a loaded machine


async def run_until_stall(h: Harness) -> tuple[StallError, float]:
    t0 = time.monotonic()
    with pytest.raises(StallError) as info:
        await asyncio.wait_for(h.trainer.run(), 60)
    return info.value, time.monotonic() - t0


async def test_a_reward_that_hangs_is_named_within_the_timeout(tmp_path):
    release = threading.Event()

    def hung_reward(response, ground_truth, **_):
        release.wait(120)  # past the stall timeout, inside reward.timeout_s (30 s)
        return 1.0

    register_reward("hangs", hung_reward)
    h = Harness(tmp_path, rows=rows_of("hangs"), stall_timeout_s=STALL_S)
    try:
        err, took = await run_until_stall(h)
    finally:
        release.set()
    assert err.stage == "reward"
    assert took < h.agent.rewards.timeout_s  # before the reward's own deadline
    text = str(err)
    assert re.search(r"the stalled stage is reward: [1-4] in flight", text)  # of 4 workers
    assert "data_source 'hangs'" in text
    assert "trainer phase: step 1: waiting for a batch of 2 prompt groups" in text
    assert "generation requests in flight per replica: s0: 0" in text
    assert "replica weight versions: s0: 0" in text
    assert f"stacks of every thread and asyncio task: {err.stacks}" in text
    assert err.stacks.parent == tmp_path / "logs" / "logs"  # the run's log directory
    stacks = err.stacks.read_text()
    assert stacks.startswith("stall: nothing advanced")
    assert "in hung_reward" in stacks  # the reward's thread, where it waits
    assert "--- asyncio task rollout-worker-0" in stacks
    assert h.trainer.trained_uids == []


class HangsInUpdate(FakeEngine):
    def __init__(self, hang_at: int) -> None:
        super().__init__()
        self.hang_at = hang_at
        self.release = threading.Event()

    def update(self, mini_batch, temperature=None):
        if self.updates + 1 == self.hang_at:
            self.release.wait(120)
        return super().update(mini_batch)


async def test_an_update_that_never_returns_is_named_with_its_step_and_mini_batch(tmp_path):
    engine = HangsInUpdate(hang_at=3)  # step 2's first mini-batch (2 per step)
    h = Harness(tmp_path, engine=engine, stall_timeout_s=STALL_S)
    try:
        err, _ = await run_until_stall(h)
    finally:
        engine.release.set()
    assert err.stage == "update"
    text = str(err)
    assert "the stalled stage is update: 1 in flight; the oldest for" in text
    assert "(step 2, mini-batch 1/2, epoch 1/1)" in text
    assert "trainer phase: step 2, in update (step 2, mini-batch 1/2, epoch 1/1)" in text
    assert "replica weight versions: s0: 1" in text  # synced at step 1


async def test_a_coroutine_that_blocks_the_event_loop_is_reported_from_the_watchdog_thread(
    tmp_path, caplog
):
    seen: list[list] = []
    calls = itertools.count()

    async def blocking_reward(response, ground_truth, **_):
        if next(calls) == 0:
            time.sleep(2 * STALL_S + 1)  # blocks the loop: no timeout can cut it
            seen.append(sorted((tmp_path / "logs" / "logs").glob("stall-*.txt")))
        return 1.0

    register_reward("blocks", blocking_reward)
    h = Harness(tmp_path, rows=rows_of("blocks"), stall_timeout_s=STALL_S)
    with caplog.at_level(logging.ERROR, logger="offbeat.core.trainer.watchdog"):
        err, _ = await run_until_stall(h)
    assert seen and seen[0] == [err.stacks]  # written while the loop was blocked
    assert err.stage == "event_loop"
    text = str(err)
    assert "the event loop has run nothing for" in text
    assert "in blocking_reward\n    time.sleep(" in text  # where the loop's thread is
    assert "the stalled stage is" in text  # the stages' report follows
    assert any("the event loop has run nothing" in r.getMessage() for r in caplog.records)


BLOCKED_FOREVER = """
import asyncio, logging, sys, time
from offbeat.core.trainer.watchdog import StallWatchdog

async def main():
    watchdog = StallWatchdog(1.0, dump_dir=sys.argv[1], exit_after_s=2.0)
    watchdog.arm()
    time.sleep(300)  # a coroutine that never yields: nothing inside can stop it

logging.basicConfig(level=logging.ERROR)
asyncio.run(main())
"""


def test_a_loop_blocked_for_good_exits_the_process_after_the_report(tmp_path):
    """The report and the stacks first; then, the loop still running nothing for
    exit_after_s, the process exits with EXIT_BLOCKED instead of hanging."""
    import subprocess
    import sys

    from offbeat.core.trainer.watchdog import EXIT_BLOCKED

    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED_FOREVER)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert proc.returncode == EXIT_BLOCKED == 70, proc.stderr[-3000:]
    err = proc.stderr
    report = err.index("the event loop has run nothing for")
    exit_line = err.index("nothing can stop the run from inside: the process exits with code 70")
    assert report < exit_line and "in main\n    time.sleep(300)" in err[exit_line:]
    (dump,) = (tmp_path / "logs").glob("stall-*.txt")  # written before the exit
    assert "time.sleep(300)" in dump.read_text()
    assert took < 100  # never the 300 s of the sleep


async def test_a_checkpoint_save_longer_than_the_timeout_does_not_trip_it(tmp_path):
    engine = FakeEngine(save_s=1.5 * STALL_S)  # the buffer is full long before it ends
    h = Harness(
        tmp_path, engine=engine, save_freq=1, total_training_steps=2, stall_timeout_s=STALL_S
    )
    summary = await h.run()
    assert summary["steps"] == 2 and len(engine.saves) == 2
    assert not list((tmp_path / "logs" / "logs").glob("stall-*.txt"))


class SwallowsOneCancel(TrainerGroup):
    """A trainer group whose update hangs and swallows the first cancellation, then hangs
    again."""

    swallowed = 0

    async def update(self, mini_batch, temperature=None):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.swallowed += 1
        await asyncio.Event().wait()


async def test_a_cancellation_swallowed_on_its_way_is_sent_again(tmp_path, monkeypatch):
    monkeypatch.setattr(StallWatchdog, "recancel_s", 0.5)
    group = SwallowsOneCancel.around(FakeEngine())
    h = Harness(tmp_path, engine=group, stall_timeout_s=STALL_S)
    try:
        err, _ = await run_until_stall(h)
    finally:
        group.shutdown()
    assert err.stage == "update" and group.swallowed == 1


class SlowStart:
    """A `Replacement.start` whose new replica takes `seconds` to come up."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def __call__(self, dead_id, new_id, dead):
        await asyncio.sleep(self.seconds)
        return FakeServer(new_id)


async def test_a_replica_replacement_longer_than_the_timeout_does_not_trip_it(tmp_path):
    # The only replica dies while step 2 trains: nothing can advance until its
    # replacement is up, which takes longer than the timeout.
    start = Replacement(SlowStart(1.5 * STALL_S), attempts=1, backoff_s=0.01)
    h = Harness(tmp_path, total_training_steps=3, stall_timeout_s=STALL_S, replacement=start)
    s0, real_update = h.servers["s0"], h.engine.update

    def update(mini_batch, temperature=None):
        if h.trainer.step == 2:
            s0.dead = True
        return real_update(mini_batch, temperature)

    h.engine.update = update
    summary = await h.run()
    assert summary["steps"] == 3 and h.pool.replaced == {"s0": "s0-r1"}
    assert not list((tmp_path / "logs" / "logs").glob("stall-*.txt"))

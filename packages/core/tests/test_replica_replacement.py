"""Dead rollout replicas are replaced: bounded attempts with doubling backoff, and a
replacement joins the balancer only once it holds the trainer's weight version."""

from __future__ import annotations

import asyncio

import pytest
import torch
from trainer_fakes import FakeServer, Harness, check_accounting

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.ckpt_engine import CheckpointEngineManager
from offbeat.core.trainer import replicas as replicas_module
from offbeat.core.trainer.replicas import Replacement, ReplicaPool


def weights():
    yield "model.w", torch.full((4,), 2.0)


class Starts:
    """A `Replacement.start` that fails `failures` times, then starts a FakeServer."""

    def __init__(self, failures: int = 0, tick_s: float = 0.0005) -> None:
        self.failures, self.tick_s = failures, tick_s
        self.calls: list[tuple[str, str, object]] = []
        self.started: dict[str, FakeServer] = {}

    async def __call__(self, dead_id, new_id, dead):
        self.calls.append((dead_id, new_id, dead))
        if len(self.calls) <= self.failures:
            raise RuntimeError(f"no room for {new_id}")
        server = self.started[new_id] = FakeServer(new_id, self.tick_s)
        return server


@pytest.fixture
def sleeps(monkeypatch):
    """The backoff delays the pool asked for (and no real waiting)."""
    asked: list[float] = []
    real = asyncio.sleep

    async def fake(delay, *a, **k):
        asked.append(delay)
        await real(0)

    monkeypatch.setattr(replicas_module.asyncio, "sleep", fake)
    return asked


def make_pool(starts, attempts=3, backoff_s=1.0):
    s0 = FakeServer("s0")
    balancer = AsyncLoadBalancer({"s0": s0})
    pool = ReplicaPool(
        {"s0": s0}, balancer, CheckpointEngineManager("naive"), health_timeout_s=2,
        replacement=Replacement(starts, attempts=attempts, backoff_s=backoff_s),
    )  # fmt: skip
    return s0, balancer, pool


async def test_a_replacement_joins_only_at_the_trainer_weight_version(sleeps):
    starts = Starts()
    s0, balancer, pool = make_pool(starts)
    await pool.sync(weights, 2)
    s0.dead = True
    assert await pool.on_engine_error(ConnectionError("s0 died")) is True  # retry: it comes
    await asyncio.wait(list(pool.replacing.values()))
    assert starts.calls == [("s0", "s0-r1", s0)]  # the dead one is handed over to be freed
    new = starts.started["s0-r1"]
    assert pool.joining == {"s0-r1": new} and new.weight_version == 0
    assert balancer.servers() == []  # not serving before it holds version 2
    assert await pool.admit(weights, 2) == ["s0-r1"]
    assert balancer.servers() == ["s0-r1"] and new.weight_version == 2
    assert torch.equal(new.weights["model.w"], torch.full((4,), 2.0))
    assert pool.replaced == {"s0": "s0-r1"} and "s0" in pool.removed
    assert pool.counts() == {
        "replicas/standalone": 1.0, "replicas/removed_total": 1.0, "replicas/replaced_total": 1.0,
    }  # fmt: skip
    assert sleeps == []  # the first start is at once


async def test_failed_starts_back_off_doubling_and_give_up_after_the_bound(sleeps):
    starts = Starts(failures=10)
    s0, _, pool = make_pool(starts, attempts=3, backoff_s=0.5)
    s0.dead = True
    await pool.check_health()
    await asyncio.wait(list(pool.replacing.values()))
    assert [new for _, new, _ in starts.calls] == ["s0-r1", "s0-r2", "s0-r3"]
    assert sleeps == [0.5, 1.0]  # retry k after backoff * 2**(k-1)
    assert "s0" in pool.gave_up and "no room for s0-r3" in pool.gave_up["s0"]
    assert pool.replacing == {} and pool.joining == {}
    assert await pool.on_engine_error(ConnectionError("gone")) is False  # nothing comes


async def test_a_retry_succeeds_within_the_bound(sleeps):
    starts = Starts(failures=1)
    s0, _, pool = make_pool(starts, attempts=2, backoff_s=0.25)
    s0.dead = True
    await pool.check_health()
    await asyncio.wait(list(pool.replacing.values()))
    assert list(pool.joining) == ["s0-r2"] and sleeps == [0.25]
    assert starts.calls[1][2] is None  # freed by the first attempt already


async def test_a_sync_waits_for_the_replacement_of_the_only_replica(sleeps):
    starts = Starts()
    s0, balancer, pool = make_pool(starts)
    s0.dead = True
    await pool.check_health()
    result = await pool.sync(weights, 1)  # no live replica: waits, then syncs the new one
    assert result.succeeded == ["s0-r1"] and balancer.servers() == ["s0-r1"]
    assert starts.started["s0-r1"].weight_version == 1


async def test_a_replica_removed_during_a_sync_with_its_replacement_ready_is_not_the_end(sleeps):
    """A health check removes the only replica while a sync to it runs, and the
    replacement is started (waiting to join) before the sync returns: the sync must not
    raise NoReplicasLeft; it brings the replacement to the version before it returns."""
    starts = Starts()
    _, balancer, pool = make_pool(starts)
    real_sync = pool.manager.sync

    async def sync_while_removed(named_tensors, version, targets):
        if "s0" in targets:
            await pool.remove_dead({"s0": "health check: dead"})
            await asyncio.gather(*pool.replacing.values())  # the replacement is started
            assert "s0-r1" in pool.joining and not pool.servers
        return await real_sync(named_tensors, version, targets=targets)

    pool.manager.sync = sync_while_removed
    result = await pool.sync(weights, 1)
    assert result.succeeded == ["s0", "s0-r1"] and pool.server_ids == ["s0-r1"]
    assert balancer.servers() == ["s0-r1"] and starts.started["s0-r1"].weight_version == 1


async def test_a_sync_that_loses_its_only_replica_brings_the_replacement_to_its_version(sleeps):
    """The only replica died unnoticed and fails the sync: the sync waits for its
    replacement and syncs it, so the trainer never goes on with no replica (what it awaits
    next, its validation or a batch, would wait forever for one only a later sync admits)."""
    starts = Starts()
    s0, balancer, pool = make_pool(starts)
    s0.dead = True
    result = await pool.sync(weights, 1)
    assert "s0" in result.failed and result.succeeded == ["s0-r1"]
    assert pool.server_ids == ["s0-r1"] and balancer.servers() == ["s0-r1"]
    assert starts.started["s0-r1"].weight_version == 1 and pool.last_sync is result


async def test_a_sync_that_loses_its_only_replica_raises_once_replacements_give_up(sleeps):
    starts = Starts(failures=5)
    s0, _, pool = make_pool(starts, attempts=2)
    s0.dead = True
    with pytest.raises(replicas_module.NoReplicasLeft, match="replacements given up"):
        await pool.sync(weights, 1)
    assert len(starts.calls) == 2 and "s0" in pool.gave_up


async def test_a_replica_failing_a_sync_is_removed_for_what_its_health_probe_says(sleeps):
    """A replica whose engine died while nothing was generating fails the sync first (its
    receiver never connects): the probe after the sync names the cause; a live replica
    that failed the sync keeps the sync's reason."""
    s0, s1 = FakeServer("s0"), FakeServer("s1")
    pool = ReplicaPool(
        {"s0": s0, "s1": s1}, AsyncLoadBalancer({"s0": s0, "s1": s1}),
        CheckpointEngineManager("naive"), health_timeout_s=2,
    )  # fmt: skip
    real_sync = pool.manager.sync

    async def sync_without_two_receivers(named_tensors, version, targets):
        s1.dead = True  # dies during the transfer: the sync only sees a receiver missing
        result = await real_sync(named_tensors, version, targets={"s2": targets["s0"]})
        result.failed = {n: f"transfer: receiver {k} did not connect within 150.0s"
                         for k, n in enumerate(["s0", "s1"])}  # fmt: skip
        return result

    pool.manager.sync = sync_without_two_receivers
    with pytest.raises(replicas_module.NoReplicasLeft):
        await pool.sync(weights, 1)
    assert pool.removed["s0"] == "transfer: receiver 0 did not connect within 150.0s"
    assert pool.removed["s1"] == (
        "health check: ConnectionError: s1 is dead "
        "(the sync: transfer: receiver 1 did not connect within 150.0s)"
    )


async def test_a_sync_drops_a_replica_whose_probe_fails_without_waiting_out_its_receiver():
    """The engine of s1 died while nothing was generating: its actor still takes the
    transfer call, but nothing will ever connect. The manager's health probe (the pool's)
    drops it within a poll, not after the receiver's connect timeout (here 60 s)."""

    class EngineDead(FakeServer):
        """Its proxy reports the last version it saw; the probe asks the engine."""

        @property
        def weight_version(self):
            return self._version

        async def refresh(self):
            raise ConnectionError(f"{self.server_id}'s engine is dead")

        async def update_weights(self, spec):
            await asyncio.Event().wait()  # the call is taken; no receiver ever connects

    s0, s1 = FakeServer("s0"), EngineDead("s1")
    manager = CheckpointEngineManager("naive", phase_timeout_s=120, health_poll_s=0.1)
    pool = ReplicaPool({"s0": s0, "s1": s1}, AsyncLoadBalancer({"s0": s0, "s1": s1}), manager)
    assert manager.health_probe is not None  # the pool lent the manager its probe
    t0 = asyncio.get_running_loop().time()
    result = await pool.sync(weights, 1)
    assert asyncio.get_running_loop().time() - t0 < 10, "waited for the dead receiver"
    assert result.succeeded == ["s0"] and s0.weight_version == 1
    assert pool.server_ids == ["s0"]
    assert pool.removed["s1"] == "transfer: health check: ConnectionError: s1's engine is dead"


async def test_a_probe_that_does_not_answer_in_time_drops_nobody():
    """A replica busy receiving may answer its probe late: only a probe that raises counts."""

    class SlowProbe(FakeServer):
        async def refresh(self):
            await asyncio.sleep(1.0)
            return self.weight_version

    s0 = SlowProbe("s0")
    manager = CheckpointEngineManager("naive", health_poll_s=0.05)
    pool = ReplicaPool({"s0": s0}, AsyncLoadBalancer({"s0": s0}), manager)
    real = s0.update_weights

    async def slow_receive(spec):
        await asyncio.sleep(0.5)  # ten polls go by, each timing out
        return await real(spec)

    s0.update_weights = slow_receive
    result = await pool.sync(weights, 1)
    assert result.succeeded == ["s0"] and pool.removed == {}


async def test_zero_attempts_only_removes(sleeps):
    starts = Starts()
    s0, _, pool = make_pool(starts, attempts=0)
    s0.dead = True
    await pool.check_health()
    assert pool.replacing == {} and starts.calls == [] and pool.server_ids == []


def record_joins(h: Harness) -> list[tuple[str, int, int, bool]]:
    """(replica, its weight version, the trainer's, whether it holds the trainer's weights)
    each time one joins the balancer. The trainer's version is that of the weights it holds
    then (one per `parameter_sync_step` updates): a sync adds its joiners before
    `trainer.version` moves on."""
    joins: list[tuple[str, int, int, bool]] = []
    real_add = h.balancer.add_servers

    def add_servers(servers):
        trainer_version = h.engine.updates // h.settings.async_training.parameter_sync_step
        for i, server in servers.items():
            w = server.weights.get("model.w")
            same = w is not None and torch.equal(w, h.engine.w)
            joins.append((i, server.weight_version, trainer_version, same))
        return real_add(servers)

    h.balancer.add_servers = add_servers
    return joins


@pytest.mark.parametrize("dies", ["while_step_2_waits_for_its_batch", "while_step_2_trains"])
async def test_a_run_that_loses_its_only_replica_is_replaced_and_keeps_its_accounting(
    tmp_path, dies
):
    """The only replica dies in step 2 at a point the test forces (left to timing, the
    rollout's pace against the trainer's decided which of the two happened): while the
    trainer waits for step 2's batch, the replacement is admitted at version 1, the weights
    the trainer still holds (without it the batch never comes); while step 2 trains, it
    joins at step 2's sync, version 2. Either way at the trainer's version, never at 0, and
    every request the death interrupted finishes on the replacement."""
    starts = Starts(tick_s=0.002)
    h = Harness(tmp_path, servers=1, total_training_steps=4, tick_s=0.002,
                replacement=Replacement(starts, attempts=3, backoff_s=0.01))  # fmt: skip
    s0 = h.servers["s0"]
    joins = record_joins(h)
    died: dict[str, int] = {}  # where the trainer was when s0 died

    def die():
        c = h.buffer.core.counts()
        died.update(step=h.trainer.step, trained=c["trained"], finished=c["finished"])
        s0.dead = True

    if dies == "while_step_2_waits_for_its_batch":
        # s0 finishes g0 and g1 (step 1's batch) and nothing else until it dies, so step 2
        # finds no finished group and waits: s0 dies under that wait.
        s0.hold = lambda rid: not s0.dead and rid.split("-")[0] not in ("g0", "g1")

        async def kill_in_step_2():
            while h.trainer.step < 2:
                await asyncio.sleep(0.005)
            die()

        killer = asyncio.ensure_future(kill_in_step_2())
        summary = await h.run()
        await killer
        assert died == {"step": 2, "trained": 2, "finished": 0}  # step 2 waited, no batch
        joined_at = 1
    else:
        real_update = h.engine.update

        def update_while_it_dies(mini_batch, temperature=None):
            if h.trainer.step == 2 and not s0.dead:
                die()
            return real_update(mini_batch, temperature)

        h.engine.update = update_while_it_dies
        summary = await h.run()
        assert died["step"] == 2 and died["trained"] == 4  # step 2's batch was taken
        joined_at = 2
    assert summary["steps"] == 4 and summary["version"] == 4
    assert h.pool.replaced == {"s0": "s0-r1"} and h.pool.server_ids == ["s0-r1"]
    assert joins == [("s0-r1", joined_at, joined_at, True)]  # the trainer's version, exactly
    new = starts.started["s0-r1"]
    assert new.weight_version == 4 and new.outputs  # it served, at the trainer's versions
    assert min(o.weight_version for o in new.outputs) == joined_at
    assert h.buffer.core.counts()["failed"] == 0  # interrupted requests finished on it
    check_accounting(h)
    rows = h.train_rows()
    assert rows[-1]["replicas/replaced_total"] == 1.0 and rows[-1]["replicas/standalone"] == 1.0


class SlowStarts(Starts):
    """Replacements that take `delay_s` to start (a cold engine start)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(tick_s=0.002)
        self.delay_s = delay_s

    async def __call__(self, dead_id, new_id, dead):
        await asyncio.sleep(self.delay_s)
        return await super().__call__(dead_id, new_id, dead)


async def test_the_only_replica_dying_after_a_sync_with_a_batch_ready_does_not_hang_validation(
    tmp_path,
):
    """The only replica dies right after the sync to version 1, once the next batch is
    already complete: version 1's validation has no replica, and the trainer would train
    at once. It must first admit the replacement at version 1 (its weights still are) and
    let the validation finish there, not train and then wait forever (or give it up)."""
    starts = SlowStarts(0.2)
    h = Harness(tmp_path, servers=1, total_training_steps=3, tick_s=0.002, test_freq=1,
                replacement=Replacement(starts, attempts=3, backoff_s=0.01))  # fmt: skip
    s0, real_sync = h.servers["s0"], h.pool.sync

    async def sync_then_die(named_tensors, version):
        result = await real_sync(named_tensors, version)
        if version == 1:
            while h.buffer.core.counts()["finished"] < h.settings.data.train_batch_size:
                await asyncio.sleep(0.002)
            s0.dead = True
            assert await h.pool.check_health() == ["s0"] and not h.pool.servers
        return result

    h.pool.sync = sync_then_die
    summary = await h.run()
    assert summary["steps"] == 3 and summary["val_abandoned"] == []
    assert [v for v, _ in summary["val_history"]] == [1, 2, 3]
    new = starts.started["s0-r1"]
    val1 = [o for o in new.outputs if o.extra["request_id"].startswith("v1-")]
    assert val1 and {o.weight_version for o in val1} == {1}  # served at its own version
    check_accounting(h)


async def test_a_validation_whose_replica_dies_after_the_update_is_abandoned_not_awaited(
    tmp_path,
):
    """Version 1's validation runs on the only replica, which dies while step 2 trains:
    the weights it measured are gone, so it cannot finish at its version. The trainer gives
    it up (recorded), syncs the replacement, and goes on to the end."""
    starts = Starts(tick_s=0.002)
    h = Harness(tmp_path, servers=1, total_training_steps=3, tick_s=0.002, test_freq=1,
                replacement=Replacement(starts, attempts=3, backoff_s=0.01))  # fmt: skip
    s0 = h.servers["s0"]
    s0.hold = lambda rid: rid.startswith("v1-") and not s0.dead  # in flight until it dies
    real_update, loop = h.engine.update, asyncio.get_running_loop()

    def update_while_it_dies(mini_batch, temperature=None):  # on the trainer rank's thread
        if h.trainer.step == 2 and not s0.dead:
            assert h.trainer._val_task.get_name() == "validation-v1"  # under way
            s0.dead = True
            asyncio.run_coroutine_threadsafe(h.pool.check_health(), loop).result(30)
        return real_update(mini_batch, temperature)

    h.engine.update = update_while_it_dies
    summary = await h.run()
    assert summary["steps"] == 3 and summary["version"] == 3
    assert [v for v, _ in summary["val_abandoned"]] == [1]
    assert "lost after the trainer's weights moved on" in summary["val_abandoned"][0][1]
    assert [v for v, _ in summary["val_history"]] == [2, 3]
    assert h.pool.server_ids == ["s0-r1"] and starts.started["s0-r1"].weight_version == 3
    check_accounting(h)

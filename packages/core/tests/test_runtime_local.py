"""One trainer shape: the trainer in the driver is a `TrainerGroup` of one rank in this
process (`LocalRank`), started by `start_trainer` and driven by the training loop through
the same calls as a group of rank actors. No Ray: the local rank needs none."""

from __future__ import annotations

import asyncio
import inspect
import os
import threading

import pytest
import torch
from trainer_fakes import FakeEngine, FakeServer, Harness

from offbeat.ckpt_engine import receive
from offbeat.core.registry import TRAIN_ENGINES
from offbeat.core.runtime import (
    GroupCheckpointEngine,
    LocalRank,
    TrainerGroup,
    TrainerRank,
    TrainerRankFailed,
    start_trainer,
)
from offbeat.core.trainer import trainer as trainer_module


class ThreadNoting(FakeEngine):
    """A fake engine that notes the thread of every call the loop makes reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[str] = set()

    def update(self, mini_batch, temperature=None):
        self.threads.add(threading.current_thread().name)
        return super().update(mini_batch, temperature)

    def compute_log_probs(self, batch, temperature=1.0):
        self.threads.add(threading.current_thread().name)
        return super().compute_log_probs(batch, temperature)


class BuiltByTheJob(ThreadNoting):
    """The train engine `actor.engine` names: how `start_trainer` builds it."""

    @classmethod
    def from_job_config(cls, job):
        engine = cls()
        engine.threads.add(threading.current_thread().name)
        return engine


@pytest.fixture
def local_engine_name():
    TRAIN_ENGINES.register("local-fake", BuiltByTheJob)
    yield "local-fake"
    TRAIN_ENGINES.unregister("local-fake")


# ---- start_trainer ----------------------------------------------------------------------
async def test_the_trainer_in_the_driver_is_a_group_of_one_local_rank(local_engine_name):
    from offbeat.core.config.run import RunConfig

    cfg = RunConfig()
    cfg.runtime.trainer_in_driver = True
    cfg.actor.engine = local_engine_name
    cfg.trainer.seed = 1234
    torch.manual_seed(7)
    rng, env = torch.get_rng_state(), dict(os.environ)
    side = await start_trainer(cfg, None)  # no pools: no actor, no bundle
    try:
        group = side.group
        assert side.engine is group and isinstance(group, TrainerGroup)
        assert group.dp_size == 1 and group.roles == ("actor",)
        (handle,) = group.handles
        assert isinstance(handle, LocalRank) and group.pids == [os.getpid()]
        engine = group.local_rank.engine
        assert isinstance(engine, BuiltByTheJob)
        assert engine.threads == {"trainer-rank-0_0"}  # built on the rank's thread
        assert isinstance(side.manager, GroupCheckpointEngine)
        assert side.manager.group is group and side.manager.backend == cfg.runtime.ckpt_backend
        # The driver's process stays as it was: not reseeded, no rendezvous variables.
        assert torch.equal(torch.get_rng_state(), rng)
        # no rendezvous variables (MASTER_ADDR, RANK, ...); Ray's first import in a
        # process sets RAY_CLIENT_MODE, which a run of this file alone in the full tier sees
        assert {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} == {
            k: v for k, v in env.items() if not k.startswith("RAY_")
        }
    finally:
        await side.close()
    with pytest.raises(RuntimeError, match="shut down"):
        await handle.lr.remote()  # closed: the rank takes no more calls


# ---- the training loop drives it as a group ---------------------------------------------
class Recording(TrainerGroup):
    """The group's calls as the loop makes them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def begin_step(self, step: int) -> None:
        self.calls.append(f"begin_step {step}")
        super().begin_step(step)

    async def compute_log_probs(self, batch, temperature=None):
        self.calls.append("compute_log_probs")
        return await super().compute_log_probs(batch, temperature)

    async def update(self, mini_batch, temperature=None):
        self.calls.append("update")
        return await super().update(mini_batch, temperature)


async def test_the_loop_drives_the_in_driver_engine_through_the_group_calls(tmp_path):
    engine = ThreadNoting()
    group = Recording.around(engine)
    h = Harness(tmp_path, engine=group, old_log_prob_source="trainer", total_training_steps=2)
    try:
        summary = await h.run()
    finally:
        await h.manager.aclose()
        group.shutdown()
    assert summary["steps"] == 2 and h.servers["s0"].weight_version == 2
    per_step = ["compute_log_probs", "update", "update"]  # parameter_sync_step=2
    assert group.calls == ["begin_step 1", *per_step, "begin_step 2", *per_step]
    assert engine.updates == 4 and torch.equal(h.servers["s0"].weights["model.w"], engine.w)
    # Off the event loop's thread, on the rank's own threads.
    assert engine.threads and all(t.startswith("trainer-rank-0") for t in engine.threads)


def test_the_loop_has_no_second_engine_shape():
    """Beside the behaviour above: no call path in the loop for a bare engine."""
    source = inspect.getsource(trainer_module)
    for branch in ("iscoroutinefunction", "hasattr(self.engine", "to_thread(self.engine"):
        assert branch not in source, branch


# ---- errors -----------------------------------------------------------------------------
class FailsAtStep2(FakeEngine):
    def update(self, mini_batch, temperature=None):
        if self.updates == 2:  # step 2's first mini-batch (2 a step)
            raise ValueError("the loss is NaN")
        return super().update(mini_batch, temperature)


async def test_an_error_in_the_local_rank_names_rank_0_the_call_and_the_step(tmp_path):
    h = Harness(tmp_path, engine=FailsAtStep2(), total_training_steps=3)
    with pytest.raises(TrainerRankFailed) as info:
        await h.run()
    err = info.value
    assert (err.rank, err.what, err.step, err.died) == (0, "update", 2, False)
    assert isinstance(err.cause, ValueError)
    assert str(err) == (
        "trainer rank 0 failed in update during global step 2: ValueError: the loss is NaN"
    )
    assert h.group.failed is err  # the group takes no more calls
    with pytest.raises(TrainerRankFailed):
        await h.group.update({"attention_mask": torch.ones(1, 2)})


# ---- weight sync ------------------------------------------------------------------------
class SharesItsWeights(FakeEngine):
    """Exports its parameter itself, as a real engine does with no cast to make."""

    def export_weights(self):
        yield "model.w", self.w


class NotesPointers(FakeServer):
    """Receives through the `naive` backend, which hands the sender's tensors over as they
    are, and notes where each one's data lives."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pointers: dict[str, int] = {}

    async def update_weights(self, spec):
        def load(pairs):
            for name, t in pairs:
                self.pointers[name] = t.data_ptr()
                self.weights[name] = t.clone()

        self._version = await asyncio.to_thread(receive, spec, load, self._version)
        return self._version


async def test_a_sync_from_the_local_rank_streams_the_engine_s_own_tensors():
    """No copy and no serialisation on the way: the sender in this process reads the
    engine's export as it comes (the in-driver speed)."""
    engine = SharesItsWeights()
    engine.w += 3.0
    group = TrainerGroup.around(engine)
    manager = GroupCheckpointEngine(group, "naive", phase_timeout_s=10)
    server = NotesPointers("s0")
    try:
        result = await manager.sync(group.export_weights, 1, targets={"s0": server})
    finally:
        await manager.aclose()
        group.shutdown()
    assert result.ok and server.weight_version == 1
    assert server.pointers == {"model.w": engine.w.data_ptr()}
    assert torch.equal(server.weights["model.w"], engine.w)


# ---- the handle -------------------------------------------------------------------------
class Rank:
    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.started = threading.Event()

    def send(self) -> str:
        self.started.set()
        assert self.aborted.wait(10), "the abort never reached the rank"
        return "aborted"

    def abort(self) -> None:
        self.aborted.set()

    def thread(self) -> str:
        return threading.current_thread().name


async def test_a_local_call_starts_at_once_and_runs_beside_the_others():
    handle = LocalRank(Rank())
    try:
        send = handle.send.remote()  # not awaited yet: already running, as an actor call
        assert await asyncio.to_thread(handle.rank.started.wait, 10)
        handle.abort.remote()  # fire and forget, while `send` waits on another thread
        assert await send == "aborted"
        assert (await handle.thread.remote()).startswith("trainer-rank-0")
        with pytest.raises(AttributeError, match="no method 'nothing'"):
            handle.nothing.remote()
    finally:
        handle.kill()


def test_a_group_around_nothing_is_refused():
    with pytest.raises(ValueError, match="give it an engine"):
        TrainerGroup.around()


def test_a_rank_alone_exports_where_a_rank_of_several_gathers():
    class Gathers(FakeEngine):
        def gather_weights(self, dst=0):
            yield "gathered", torch.zeros(1)

    alone, of_two = TrainerRank(0, 1), TrainerRank(0, 2)
    assert alone._gather(Gathers()) is None  # its export: no gather buffer to copy into
    assert of_two._gather(Gathers()) is not None

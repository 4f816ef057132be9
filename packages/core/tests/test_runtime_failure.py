"""A trainer rank that dies mid-run stops the run with an error naming the rank and the
global step (not a hang), and the run restarts by itself from the last checkpoint
(`run_with_restarts`) and continues with the same accounting. Two gloo FSDP2 ranks on a local Ray drive the real training loop with
the fakes of `trainer_fakes` (rollout servers that receive the weights rank 0 sends over
shm)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from test_runtime_group import job, on_every_rank, weights
from trainer_fakes import Harness, check_accounting

from offbeat.core.config.run import RunConfig
from offbeat.core.models import build_tiny_model
from offbeat.core.runtime import GroupCheckpointEngine, TrainerGroup, TrainerRankFailed
from offbeat.core.runtime.group import split_by_tokens
from offbeat.core.stacks import DIAGNOSTICS_GROUPS, actor_stacks, diagnostics_method, process_stacks
from offbeat.core.trainer.restart import run_with_restarts
from offbeat.core.trainer.watchdog import StallError

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


class DiesAtStep(TrainerGroup):
    """Kills rank `victim`'s process (SIGKILL) when global step `kill_at` reaches its
    update: the other rank is then in the step's collectives, or about to be."""

    kill_at, victim = 3, 1
    killed = False

    async def update(self, mini_batch, temperature=None):
        if self.step == self.kill_at and not self.killed:
            self.killed = True
            os.kill(self.pids[self.victim], signal.SIGKILL)
        return await super().update(mini_batch, temperature)


class SkipsRankAtStep(TrainerGroup):
    """At global step `at`, rank `absent` is never given its mini-batch: the other rank's
    update waits in the step's first collective for a peer that never joins it."""

    at, absent = 2, 1

    async def update(self, mini_batch, temperature=None):
        if self.step != self.at:
            return await super().update(mini_batch, temperature)
        parts = split_by_tokens(mini_batch["attention_mask"].sum(dim=1).tolist(), self.dp_size)
        ranks = [r for r in range(self.dp_size) if r != self.absent]
        refs = [
            self.handles[r].update.remote(
                {k: v.index_select(0, torch.tensor(parts[r])) for k, v in mini_batch.items()},
                temperature,
            )
            for r in ranks
        ]
        return (await self._all("update", refs, ranks=ranks))[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny"), hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
    )  # fmt: skip


@pytest.fixture(scope="module")
def ray_local(ray_session):
    return ray_session.up()


async def start_group(cls, model_dir: Path) -> TrainerGroup:
    cfg = job(model_dir, 2)
    cfg.trainer.total_training_steps = 4
    cfg.async_training.parameter_sync_step = 2
    return await cls.start(cfg, 2, options=[{"num_cpus": 1}] * 2)


def harness(tmp: Path, group: TrainerGroup, **settings) -> Harness:
    h = Harness(tmp, engine=group, **{"save_freq": 1, **settings})
    h.pool.manager = GroupCheckpointEngine(group, "shm", phase_timeout_s=30)
    return h


def test_a_dead_rank_stops_the_run_naming_it_and_the_step_then_it_restarts_and_resumes(
    ray_local, model_dir, tmp_path
):
    """Rank 1 is SIGKILLed in step 3's update: the run fails naming the rank and the step,
    and `run_with_restarts` (what the recipes' mains call) runs it again with
    trainer.resume=true on a fresh group, from step 2's checkpoint, to the end: the same
    data order, no prompt lost or duplicated by the ledger, the weights rank 0 holds on
    the replica."""
    attempts: list[tuple[Harness, list[int]]] = []  # each attempt, its checkpoints after

    async def attempt(cfg):
        group = await start_group(TrainerGroup if attempts else DiesAtStep, model_dir)
        h = harness(tmp_path, group, total_training_steps=4, resume=cfg.trainer.resume)
        ckpts: list[int] = []
        attempts.append((h, ckpts))
        try:
            summary = await h.run()
            summary["sent"] = on_every_rank(group, weights)[0]
            return summary
        finally:
            ckpts += [s for s, _ in h.checkpoints.complete()]
            await h.pool.manager.aclose()
            group.shutdown()

    cfg = RunConfig()
    cfg.trainer.save_freq = 1  # the harness's; trainer.max_restarts null: 2
    summary = asyncio.run(run_with_restarts(attempt, cfg))
    (h1, ckpts1), (h2, _) = attempts
    assert summary["restarts"] == 1
    assert summary["restart_causes"][0].startswith(
        "trainer rank 1 failed in update during global step 3: ActorDiedError"
    )
    assert ckpts1 == [1, 2]  # nothing written for step 3
    assert summary["steps"] == 4 and summary["version"] == 4
    # the replicas were brought to the restored version 2, then synced at steps 3 and 4
    assert [r.version for r in h2.trainer.sync_results] == [3, 4]
    per_step = h1.settings.data.train_batch_size
    assert h2.trainer.trained_uids[: 2 * per_step] == h1.trainer.trained_uids[: 2 * per_step]
    assert len(h2.trainer.trained_uids) == 4 * per_step
    check_accounting(h2)
    prompts, ledger = summary["prompts"], h2.buffer.core.prompts
    positions = [r.position for r in ledger.records()]
    assert len(positions) == len(set(positions))  # none duplicated
    assert set(positions) == set(range(prompts["first_position"], prompts["next_position"]))
    assert prompts["resumes"] == 1
    server = h2.servers["s0"]
    assert server.weight_version == 4
    for name, w in summary["sent"].items():
        assert torch.equal(server.weights[name], w), name


def test_a_rank_that_hangs_fails_the_call_after_the_timeout_naming_it(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Rank:
        def ok(self) -> int:
            return 1

        def hang(self) -> None:
            time.sleep(3600)

    group = TrainerGroup([Rank.remote(), Rank.remote()])
    ray.get([h.ok.remote() for h in group.handles])  # both started: only rank 1 is late
    group.call_timeout_s = 2.0  # 2 x trainer.stall_timeout_s in a job
    group.begin_step(7)

    async def call():
        h = group.handles
        return await group._all("update", [h[0].ok.remote(), h[1].hang.remote()])

    with pytest.raises(TrainerRankFailed) as e:
        asyncio.run(call())
    assert (e.value.rank, e.value.step) == (1, 7)
    assert "trainer rank 1 failed in update during global step 7" in str(e.value)
    assert "ranks [1] gave no answer within 2s (the group's call timeout" in str(e.value)
    with pytest.raises(TrainerRankFailed):  # a failed group refuses further calls
        asyncio.run(call())


def test_a_rank_that_never_joins_a_collective_is_named_by_the_stall_watchdog(
    ray_local, model_dir, tmp_path
):
    """Rank 0 waits forever in step 2's collectives for rank 1, which never got its
    mini-batch: the watchdog names the update, its step and mini-batch, and the rank the
    group still waits for, within the timeout (the group's own call timeout is off)."""
    stall_s = 3.0

    async def stuck_run():
        group = await start_group(SkipsRankAtStep, model_dir)
        h = harness(tmp_path, group, save_freq=-1, total_training_steps=4, stall_timeout_s=stall_s)
        t0 = time.monotonic()
        try:
            with pytest.raises(StallError) as e:
                await asyncio.wait_for(h.trainer.run(), 120)
        finally:
            await h.pool.manager.aclose()
            group.shutdown()
        return e.value, time.monotonic() - t0

    err, took = asyncio.run(stuck_run())
    assert err.stage == "update"
    text = str(err)
    assert "the stalled stage is update: 1 in flight; the oldest for" in text
    assert "(step 2, mini-batch 1/2, epoch 1/1)" in text
    assert "trainer group calls waiting for ranks: update: ranks [0] for" in text
    assert err.stacks is not None and err.stacks.is_file()
    assert took < 60  # named once the timeout passed, never waited out
    # Each rank's own process gave its stacks too: rank 0 where it waits in the update's
    # collective, rank 1 idle; the driver's come first.
    assert "stacks of trainer rank 0, trainer rank 1 in the same file" in text
    dump = err.stacks.read_text()
    rank0 = dump.index("=== actor trainer rank 0\npid ")
    rank1 = dump.index("=== actor trainer rank 1\npid ")
    assert dump.index("--- thread MainThread") < rank0 < rank1
    stuck = dump[rank0:rank1]
    assert "in update" in stuck and "torch/distributed" in stuck, stuck[-3000:]
    assert "torch/distributed" not in dump[rank1:].split("=== actor")[1]


def test_actor_stacks_come_from_a_blocked_actor_in_the_diagnostics_group_only(ray_local):
    """What the stall watchdog asks the replicas: an async actor whose main loop is blocked
    answers with its stacks when the method runs in the diagnostics concurrency group (the
    vLLM replica actor's), and is named as not answering, within the timeout, otherwise."""
    import ray

    # Defined here, so Ray ships them by value (the workers cannot import this module).
    class _Blocks:
        """An async actor whose main event loop a call blocks (time.sleep in a coroutine)."""

        async def block(self, seconds: float) -> None:
            time.sleep(seconds)

        async def format_stacks(self) -> str:  # on the main loop: blocked with it
            return process_stacks()

    class _BlocksButAnswers(_Blocks):
        @diagnostics_method
        async def format_stacks(self) -> str:  # on a loop of its own
            return process_stacks()

    answers = ray.remote(num_cpus=0, concurrency_groups=DIAGNOSTICS_GROUPS)(
        _BlocksButAnswers
    ).remote()
    silent = ray.remote(num_cpus=0)(_Blocks).remote()
    ray.get([answers.__ray_ready__.remote(), silent.__ray_ready__.remote()])
    blocked = [answers.block.remote(20), silent.block.remote(20)]
    time.sleep(1)  # both loops are in time.sleep now
    t0 = time.monotonic()
    stacks = actor_stacks({"answers": answers, "silent": silent, "none": object()}, 3.0)
    took = time.monotonic() - t0
    assert list(stacks) == ["answers", "silent", "none"]
    assert stacks["answers"].startswith("pid ") and "in block" in stacks["answers"]
    assert stacks["silent"] == "(did not answer within 3 s)"
    assert stacks["none"].startswith("(no stacks: AttributeError")
    assert took < 10
    for a in (answers, silent):
        ray.kill(a)
    del blocked

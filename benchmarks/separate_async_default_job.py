"""The default job (`offbeat run separate_async`, no overrides): wall time and reward curve.

Runs the recipe exactly as the README's first command does (in-process, same config) and
prints the validation reward of every validated weight version beside the version-0
baseline (the warm-started model before any RL), plus the train reward per step and the
job's wall time, start-up included.

    uv run --frozen --no-sync python benchmarks/separate_async_default_job.py [key=value ...]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path


def main() -> None:
    from offbeat.core.cli import load_recipe_config

    module, cfg = load_recipe_config(
        "separate_async", ["runtime.progress_bar=false", *sys.argv[1:]]
    )
    summary = asyncio.run(module.run_job(cfg))
    rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    val = [r for r in rows if "val/reward" in r]
    base = val[0]["val/reward"] if val else float("nan")
    print("\n| weight version | validation reward (greedy, 64 prompts) | vs version 0 |")
    print("|---|---|---|")
    for r in val:
        print(f"| {int(r['step'])} | {r['val/reward']:.3f} | {r['val/reward'] - base:+.3f} |")
    print("\n| steps | mean train reward (n samples per prompt, T=1) | mean staleness |")
    print("|---|---|---|")
    k = max(1, len(train) // 6)
    for i in range(0, len(train), k):
        chunk = train[i : i + k]
        reward = sum(r["reward/mean"] for r in chunk) / len(chunk)
        stale = sum(r["off_policy/trajectory_staleness_mean"] for r in chunk) / len(chunk)
        print(f"| {int(chunk[0]['step'])}-{int(chunk[-1]['step'])} | {reward:.3f} | {stale:.2f} |")
    steps_s = sum(r["timing/step_s"] for r in train)
    print(
        f"\nwall time {summary['total_wall_s']:.0f}s (start-up {summary['startup_s']:.0f}s, "
        f"{len(train)} steps {steps_s:.0f}s); load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs\nplot: {summary['plot']}"
    )


if __name__ == "__main__":
    main()

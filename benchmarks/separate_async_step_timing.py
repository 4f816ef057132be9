"""The default job's step timings, before and after the sync-abort fix and the resource split.

Runs the default job (`offbeat run separate_async`, same config; `--steps` global steps,
15 by default) once per path, one after the other, each on its own Ray and replica, and
reads every step's metrics from the job's JSONL. Prints per path: `timing/sync_s` and its
abort phase (p50 / p99), and the spread of `timing/train_s` (min / median / max / stdev):
the train work is the same every step (the same batch shape), so its spread is what the
trainer loses to processes sharing its core.

Paths: `old` is the code path before the fix, selected by flag (one Ray actor call per
sample; every call straight into vLLM, no admission bound; the replica's processes
unconfined, only vLLM's OpenMP threads bound to core 0; only the trainer's main thread
pinned to core 1); `new` is the recipe as it is.

    uv run --frozen --no-sync python benchmarks/separate_async_step_timing.py \
        [--paths old,new] [--steps 15] [key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def run_path(path: str, args: argparse.Namespace, tmp: Path) -> dict:
    from job_common import OLD_PATH_OVERRIDES, loadavg, old_server_config

    from offbeat.core.cli import load_recipe_config
    from offbeat.core.runtime.host import init_ray, pin_trainer
    from offbeat.core.trainer.elastic import shutdown_replicas, start_replicas
    from offbeat.core.trainer.job import run_with_replicas
    from offbeat.core.trainer.prepare import prepare

    overrides = [
        f"trainer.total_training_steps={args.steps}",
        f"trainer.log_dir={tmp}",
        f"trainer.experiment_name={path}",
        f"trainer.checkpoint_dir={tmp / 'ckpt' / path}",
        "trainer.save_freq=-1",
        "trainer.loggers=[jsonl]",
        "runtime.progress_bar=false",
        *(OLD_PATH_OVERRIDES if path == "old" else []),
        *args.overrides,
    ]
    _, cfg = load_recipe_config("separate_async", overrides)
    rt = cfg.runtime
    load = [loadavg()]
    t0 = time.perf_counter()
    init_ray(rt)
    if path == "old":
        if rt.trainer_cpus:  # what pin_trainer did before: the calling thread only
            os.sched_setaffinity(0, set(rt.trainer_cpus))
    else:
        pin_trainer(rt)
    p = await asyncio.to_thread(prepare, cfg)
    with old_server_config(path == "old"):
        servers = start_replicas(p)
    for s in servers.values():
        s.batched = path != "old"
    try:
        summary = await run_with_replicas(p, servers, version_offset=0)
    finally:
        await shutdown_replicas(servers)
    wall = time.perf_counter() - t0
    load.append(loadavg())
    rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
    rows = [r for r in rows if "timing/train_s" in r]
    return {"path": path, "rows": rows, "wall_s": wall, "load": load}


def report(results: list[dict]) -> None:
    print(
        f"\nThe default job, {results[0]['rows'][-1]['step']:.0f} steps per path, "
        f"{os.cpu_count()} CPUs shared with other work. Seconds."
    )
    print(
        "\n| path | sync_s p50 | sync_s p99 | sync abort p50 | sync abort p99 "
        "| train_s min | median | max | stdev | step_s mean | wall (s) | load avg before -> after |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        rows = res["rows"]
        sync = [r["timing/sync_s"] for r in rows]
        abort = [r["timing/sync_abort_s"] for r in rows]
        train = [r["timing/train_s"] for r in rows]
        step = [r["timing/step_s"] for r in rows]
        print(
            f"| {res['path']} | {pct(sync, 0.5):.3f} | {pct(sync, 0.99):.3f} "
            f"| {pct(abort, 0.5):.3f} | {pct(abort, 0.99):.3f} "
            f"| {min(train):.2f} | {statistics.median(train):.2f} | {max(train):.2f} "
            f"| {statistics.stdev(train):.2f} | {statistics.mean(step):.2f} "
            f"| {res['wall_s']:.0f} | {' -> '.join(res['load'])} |"
        )
    print("\nper step, sync_s / train_s:")
    for res in results:
        steps = " ".join(f"{r['timing/sync_s']:.2f}/{r['timing/train_s']:.2f}" for r in res["rows"])
        print(f"  {res['path']}: {steps}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="old,new")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--json", default="", help="also write the raw per-step figures here")
    ap.add_argument("overrides", nargs="*", help="recipe config overrides for every path")
    args = ap.parse_args()
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="offbeat-steps-"))
    cores = os.sched_getaffinity(0)
    results = []
    for path in args.paths.split(","):
        results.append(asyncio.run(run_path(path, args, tmp)))
        # The next path starts from an unpinned driver and a fresh Ray.
        ray.shutdown()
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cores)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results))


if __name__ == "__main__":
    main()

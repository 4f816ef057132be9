"""The default job (`offbeat run separate_async`) over several seeds: the final validation
reward, the job's wall time and `replicas_ready`, each run beside the load average.

A seed moves every random source of the run: the RL trainer (`trainer.seed`), the data
order (`data.seed`), the engine's sampling (`rollout.engine_kwargs.seed`) and the warm
start (`warm_start.seed`). The task and the model's random init stay fixed. Each seed's
warm start is built first (cached, as a second run finds it), then the seeds run one after
another, each job in a fresh process as `./offbeat run separate_async` runs it. The final
value counts (issue: >= 0.8, median of 3 seeds, each job <= 3 min on a warm cache).

    uv run --frozen --no-sync python benchmarks/separate_async_seeds.py [--seeds 0,1,2] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def seed_overrides(seed: int) -> list[str]:
    return [
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        f"rollout.engine_kwargs.seed={seed}",
        f"warm_start.seed={seed}",
        f"trainer.experiment_name=seed{seed}",
    ]


def prebuild(overrides: list[str]) -> float:
    """The run's `prepare` (task files, tiny model, warm start) in a process of its own."""
    code = (
        "import sys\n"
        "from offbeat.core.cli import load_recipe_config\n"
        "from offbeat.core.trainer.prepare import prepare\n"
        "_, cfg = load_recipe_config('separate_async', sys.argv[1:])\n"
        "print(prepare(cfg).setup_s)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *overrides], check=True, capture_output=True, text=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def run_one(overrides: list[str]) -> dict:
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "offbeat.core.cli", "run", "separate_async", *overrides],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"run failed: {' '.join(overrides)}")
    ready = re.search(r"replicas_ready=([\d.]+)s", proc.stdout)
    name = next(o.split("=", 1)[1] for o in overrides if o.startswith("trainer.experiment_name="))
    rows = [
        json.loads(x) for x in (ROOT / "outputs" / name / "metrics.jsonl").read_text().splitlines()
    ]
    val = [(int(r["step"]), r["val/reward"]) for r in rows if "val/reward" in r]
    return {
        "wall_s": wall,
        "replicas_ready_s": float(ready.group(1)) if ready else float("nan"),
        "val": val,
        "load_before": load0,
        "load_after": os.getloadavg()[0],
    }


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
    for s, r in results.items():
        ax.plot([v for v, _ in r["val"]], [x for _, x in r["val"]], marker="o", ms=3,
                label=f"seed {s} ({r['wall_s']:.0f} s)")  # fmt: skip
    ax.axhline(0.8, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="weight version (global step)", ylabel="validation reward (greedy, 64)",
           ylim=(0, 1), title="separate_async default job")  # fmt: skip
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--plot", default="", help="write the seeds' validation curves to this PNG")
    args, extra = ap.parse_known_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(
        f"# separate_async default job, seeds {seeds}, overrides {extra or 'none'}; {os.cpu_count()} CPUs"
    )
    for s in seeds:
        built = prebuild(seed_overrides(s) + extra)
        print(f"prepared seed {s} in {built:.1f}s", flush=True)
    results = {}
    for s in seeds:
        r = results[s] = run_one(seed_overrides(s) + extra)
        curve = "  ".join(f"{v}:{x:.3f}" for v, x in r["val"])
        print(
            f"seed {s}: final {r['val'][-1][1]:.3f} (version 0 {r['val'][0][1]:.3f}, best "
            f"{max(x for _, x in r['val']):.3f}); wall {r['wall_s']:.0f}s, replicas_ready "
            f"{r['replicas_ready_s']:.1f}s; load {r['load_before']:.1f} -> {r['load_after']:.1f}\n"
            f"  curve {curve}",
            flush=True,
        )
    finals = [r["val"][-1][1] for r in results.values()]
    if args.plot:
        plot(results, args.plot)
    print(
        "\n| seed | version 0 | final | best | wall (s) | replicas_ready (s) | load before -> after |"
    )
    print("|---|---|---|---|---|---|---|")
    for s, r in results.items():
        print(
            f"| {s} | {r['val'][0][1]:.3f} | {r['val'][-1][1]:.3f} | {max(x for _, x in r['val']):.3f} "
            f"| {r['wall_s']:.0f} | {r['replicas_ready_s']:.1f} | {r['load_before']:.1f} -> {r['load_after']:.1f} |"
        )
    print(
        f"\nmedian final {statistics.median(finals):.3f} (baseline: version 0, median "
        f"{statistics.median(r['val'][0][1] for r in results.values()):.3f}); median wall "
        f"{statistics.median(r['wall_s'] for r in results.values()):.0f}s; median replicas_ready "
        f"{statistics.median(r['replicas_ready_s'] for r in results.values()):.1f}s"
    )


if __name__ == "__main__":
    main()

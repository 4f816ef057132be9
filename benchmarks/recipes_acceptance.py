"""Every recipe's default job, full length, as a user runs it: its learning figures.

The e2e tests check learning on short runs with a stated margin (the suite has a time
budget); the full-length runs that the recipe READMEs quote live here. Each recipe runs as
`./offbeat run <recipe>` does, in its own process (its own Ray), with only its log
directory moved; the script reads the run's metrics.jsonl and prints, per recipe and seed,
the validation reward of version 0 (the warm start), the last version and the best one,
beside the wall time. The final value counts, not the best.

    uv run --frozen --no-sync python benchmarks/recipes_acceptance.py \
        [--recipes separate_async opd genrm separate_async_tools] [--seeds 0 1 2] \
        [--cache DIR]     # OFFBEAT_CACHE_DIR for the runs (default: the user's cache)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPES = ("separate_async", "opd", "genrm", "separate_async_tools")


def val_curves(metrics: Path) -> dict[str, list[tuple[int, float]]]:
    """Validation reward per version, per reward key (`val/reward`, or one per task)."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key.startswith("val/") and key.endswith("reward"):
                curves.setdefault(key, []).append((int(row.get("step", 0)), float(value)))
    return curves


def run_recipe(recipe: str, seed: int, out: Path, env: dict[str, str]) -> dict:
    log_dir = out / f"{recipe}-seed{seed}"
    cmd = [
        sys.executable, "-m", "offbeat.core.cli", "run", recipe,
        f"trainer.log_dir={log_dir}", f"trainer.seed={seed}",
        "trainer.loggers=[console,jsonl]", "runtime.progress_bar=false",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (log_dir / "console.log").parent.mkdir(parents=True, exist_ok=True)
    (log_dir / "console.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"recipe": recipe, "seed": seed, "wall_s": wall, "error": proc.stderr[-1500:]}
    metrics = next(log_dir.rglob("metrics.jsonl"))
    return {"recipe": recipe, "seed": seed, "wall_s": wall, "curves": val_curves(metrics)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--cache", help="OFFBEAT_CACHE_DIR for the runs (default: as set)")
    ap.add_argument("--out", help="where the runs' logs go (default: a temporary folder)")
    args = ap.parse_args()
    env = dict(os.environ)
    if args.cache:
        env["OFFBEAT_CACHE_DIR"] = args.cache
    out = Path(args.out or tempfile.mkdtemp(prefix="recipes-acceptance-"))
    results = []
    for recipe in args.recipes:
        for seed in args.seeds:
            r = run_recipe(recipe, seed, out, env)
            results.append(r)
            state = "failed" if "error" in r else "done"
            print(f"{recipe} seed {seed}: {state} in {r['wall_s']:.0f}s", flush=True)
            if "error" in r:
                print(r["error"])

    print("\n| recipe | seed | reward key | version 0 | last (version) | best | wall time |")
    print("|---|---|---|---|---|---|---|")
    finals: dict[tuple[str, str], list[float]] = {}
    for r in results:
        for key, curve in sorted(r.get("curves", {}).items()):
            (v0, r0), (vl, rl) = curve[0], curve[-1]
            best = max(x for _, x in curve)
            finals.setdefault((r["recipe"], key), []).append(rl)
            print(f"| {r['recipe']} | {r['seed']} | {key} | {r0:.3f} (v{v0}) | {rl:.3f} (v{vl}) "
                  f"| {best:.3f} | {r['wall_s']:.0f}s |")  # fmt: skip
    print("\n| recipe | reward key | final reward, median over seeds |")
    print("|---|---|---|")
    for (recipe, key), xs in finals.items():
        print(f"| {recipe} | {key} | {statistics.median(xs):.3f} ({len(xs)} seeds) |")
    print(f"\nload average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; logs: {out}")


if __name__ == "__main__":
    main()

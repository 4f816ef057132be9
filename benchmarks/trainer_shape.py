"""The default job's speed in two checkouts of offbeat, run alternately: e.g. before and
after a change to the trainer's shape (the in-driver trainer as a one-rank local worker
group, issue 30 item 3).

Each run is the default job (`offbeat run separate_async`, its own config) cut to
`--steps` global steps, in a fresh process of that checkout's own `.venv` (one Ray and
replica each); the checkouts take turns, `--runs` times each. Per run it reads the job's
metrics JSONL: the median of `timing/step_s`, `timing/train_s`, `timing/sync_s` and
`timing/generate_wait_s` over steps 3..N (the first two carry start-up effects), and the
wall time to the end, start-up included. Prints each run, then per checkout the median of
its runs, the ratio after/before, and the load average around every run. One unrecorded
3-step run first builds what the job caches.

`--learning`: the whole default job instead (its own step count and validations), and
per run also its validation reward before training and at the end.

    python benchmarks/trainer_shape.py --before <checkout> --after <checkout> \
        [--runs 3] [--steps 15 | --learning] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Runs inside the checkout's .venv: the job, then one JSON line of its figures.
CHILD = r"""
import asyncio, json, os, statistics, sys, time
from pathlib import Path
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from offbeat.core.cli import load_recipe_config

def main():
    t0 = time.perf_counter()
    module, cfg = load_recipe_config("separate_async", sys.argv[1:])
    summary = asyncio.run(module.run_job(cfg))
    rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
    steps = [r for r in rows if "timing/step_s" in r and r["step"] >= 3]
    med = lambda k: statistics.median(r[k] for r in steps)
    keys = ["timing/step_s", "timing/train_s", "timing/sync_s", "timing/generate_wait_s"]
    out = {k: med(k) for k in keys}
    out["wall_s"] = time.perf_counter() - t0
    vals = [r["val/reward"] for r in rows if "val/reward" in r]
    out["val_first"], out["val_last"] = (vals[0], vals[-1]) if vals else (None, None)
    out["steps"] = summary["steps"]
    print("RESULT " + json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
"""


def run_once(checkout: Path, steps: int | None, extra: list[str], tmp: Path, tag: str) -> dict:
    python = checkout / ".venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{checkout}: no .venv (run `./offbeat test --fast -k nothing` there)")
    cut = [] if steps is None else [
        f"trainer.total_training_steps={steps}", "trainer.test_freq=0",
        "trainer.val_before_train=false",
    ]  # fmt: skip
    overrides = [
        *cut, "trainer.save_freq=-1", "runtime.progress_bar=false", "trainer.loggers=[jsonl]",
        f"trainer.log_dir={tmp}", f"trainer.experiment_name={tag}", *extra,
    ]  # fmt: skip
    load0 = os.getloadavg()[0]
    proc = subprocess.run(
        [str(python), "-c", CHILD, *overrides], cwd=checkout, capture_output=True, text=True
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{tag} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    got = json.loads(lines[-1].removeprefix("RESULT "))
    got["load"] = (load0, os.getloadavg()[0])
    return got


def _val(got: dict) -> str:
    if got.get("val_first") is None:
        return "no validation"
    return f"val/reward {got['val_first']:.3f} -> {got['val_last']:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--learning", action="store_true", help="the whole default job")
    args, extra = ap.parse_known_args()
    results: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="trainer-shape-") as tmp:
        # Unrecorded: builds what the job caches (the model, its warm start) on a first run.
        run_once(args.before.resolve(), 3, extra, Path(tmp), "warmup")
        for i in range(args.runs):
            for name in ("before", "after"):
                steps = None if args.learning else args.steps
                got = run_once(getattr(args, name).resolve(), steps, extra, Path(tmp), f"{name}{i}")
                results[name].append(got)
                print(
                    f"run {i} {name:6s}: step {got['timing/step_s']:.3f}s "
                    f"(train {got['timing/train_s']:.3f}, sync {got['timing/sync_s']:.3f}, "
                    f"wait {got['timing/generate_wait_s']:.3f}); wall {got['wall_s']:.0f}s; "
                    f"{_val(got)}; load {got['load'][0]:.1f} -> {got['load'][1]:.1f}",
                    flush=True,
                )
    what = "the whole job" if args.learning else f"{args.steps} steps"
    print(f"\nmedian of {args.runs} runs, {what} each (step times over steps 3..N per run):")
    print("| | step s | train s | sync s | wait s | wall s |\n|---|---|---|---|---|---|")
    med: dict[str, dict[str, float]] = {}
    for name, runs in results.items():
        keys = ["timing/step_s", "timing/train_s", "timing/sync_s", "timing/generate_wait_s"]
        med[name] = {k: statistics.median(r[k] for r in runs) for k in [*keys, "wall_s"]}
        cells = " | ".join(f"{med[name][k]:.3f}" for k in keys)
        print(f"| {name} | {cells} | {med[name]['wall_s']:.0f} |")
        if args.learning:
            first = statistics.median(r["val_first"] for r in runs)
            last = statistics.median(r["val_last"] for r in runs)
            print(f"|   val/reward, first -> last (median) | {first:.3f} -> {last:.3f} | | | | |")
    ratio = med["after"]["timing/step_s"] / med["before"]["timing/step_s"]
    print(f"\nstep time after / before: {ratio:.3f}")
    loads = [x for rs in results.values() for r in rs for x in r["load"]]
    print(
        f"load average over the runs: {min(loads):.1f}..{max(loads):.1f} on {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    sys.exit(main())

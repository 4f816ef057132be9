"""Hybrid validation on ONE CUDA GPU through the real job: the trainer rank (a Ray actor),
its hybrid vLLM replica and the standalone replica share the GPU
(`runtime.share_trainer_gpu` with `trainer.validate_on_trainer_devices`); the hybrid
replica sleeps (level 2) while the trainer trains and wakes for every validation.

Prints, for every validation cycle inside the job: the GPU memory its going to sleep gave
back (`hybrid/sleep_freed_gb`: the device's free memory read by the replica's worker
before its KV release and after its sleep, while every other engine is paused), the
device's free memory then, and what the cycle cost around the validation itself (enter:
wake, weight sync, abort, add, resume; exit: abort, remove, KV release + sleep, resume),
with the medians over the cycles.

Baseline, measured in the same run once the job is over: a raw vLLM `LLM` of the same
model and engine arguments in this process, `sleep(level=2)` then
`wake_up(["weights"])` + `wake_up(["kv_cache"])`, with the same reads of the device's free
memory (torch.cuda.mem_get_info) around the sleep.

    python benchmarks/gpu_hybrid_validation.py [--qwen05] [--raw-cycles N] [key=value ...]

No flag: the default task and tiny model (warm start included). `--qwen05`: a random
Qwen2-0.5B-shaped model (bf16, no warm start), as `gpu_separate_async.py --qwen05`.
Defaults: 16 steps, a validation every 2 (9 cycles, version 0 included).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from gpu_separate_async import GPU_OVERRIDES, QWEN05, build_qwen05

HYBRID = ["trainer.validate_on_trainer_devices=true"]  # level 2 sleep (the default)
CYCLES = ["trainer.total_training_steps=16", "trainer.test_freq=2"]
KEYS = [
    ("hybrid/sleep_freed_gb", "freed GB"),
    ("hybrid/asleep_free_gb", "free asleep GB"),
    ("hybrid/sleep_s", "sleep s"),
    ("hybrid/wake_s", "wake s"),
    ("hybrid/sync_s", "sync s"),
    ("hybrid/enter_s", "enter s"),
    ("hybrid/exit_s", "exit s"),
    ("cost", "enter+exit s"),
    ("hybrid/validate_s", "validate s"),
    ("hybrid/served_calls", "hybrid calls"),
    ("hybrid/standalone_served_calls", "standalone calls"),
]


def raw_sleep_wake(model_dir: str, engine_kwargs: dict, cycles: int) -> list[dict[str, float]]:
    """The raw engine's cycles: free memory around `sleep(2)`, and the seconds of the
    sleep and of the wake (weights, then KV cache)."""
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, **engine_kwargs, enable_sleep_mode=True)
    prompts = [{"prompt_token_ids": [10 + i, 20, 30, 40]} for i in range(8)]
    llm.generate(prompts, SamplingParams(max_tokens=16), use_tqdm=False)
    out = []
    try:
        for _ in range(cycles):
            torch.cuda.synchronize()
            free0 = torch.cuda.mem_get_info()[0]
            t0 = time.perf_counter()
            llm.sleep(level=2)
            t1 = time.perf_counter()
            free1 = torch.cuda.mem_get_info()[0]
            t2 = time.perf_counter()
            llm.wake_up(tags=["weights"])
            llm.wake_up(tags=["kv_cache"])
            t3 = time.perf_counter()
            out.append({"freed_gb": (free1 - free0) / 1e9, "free_asleep_gb": free1 / 1e9,
                        "sleep_s": t1 - t0, "wake_s": t3 - t2})  # fmt: skip
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return out


def main() -> None:
    import ray
    import torch

    from offbeat.core.cli import load_recipe_config
    from offbeat.core.trainer.prepare import prepare
    from offbeat.rollout_vllm.replica import engine_kwargs_of, register

    register()  # also where the packages are on PYTHONPATH only (no entry points)

    args = sys.argv[1:]
    raw_cycles = 5
    if "--raw-cycles" in args:
        i = args.index("--raw-cycles")
        raw_cycles = int(args[i + 1])
        del args[i : i + 2]
    extra = []
    if "--qwen05" in args:
        args.remove("--qwen05")
        extra = [f"model.path={build_qwen05()}", *QWEN05]
    module, cfg = load_recipe_config(
        "separate_async", [*GPU_OVERRIDES, *HYBRID, *extra, *CYCLES, *args]
    )
    t0 = time.perf_counter()
    try:
        summary = asyncio.run(module.run_job(cfg))
    finally:
        ray.shutdown()
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    cycles = [r for r in rows if "hybrid/replicas" in r]
    for r in cycles:
        r["cost"] = r["hybrid/enter_s"] + r["hybrid/exit_s"]
    props = torch.cuda.get_device_properties(0)
    util = cfg.rollout.engine_kwargs["gpu_memory_utilization"]
    print(
        f"\nGPU: {props.name} ({props.total_memory / 1e9:.1f} GB), one GPU shared by the trainer "
        f"rank, its hybrid replica and the standalone replica (each engine "
        f"gpu_memory_utilization={util}: {util * props.total_memory / 1e9:.1f} GB awake); model "
        f"{cfg.model.path} ({cfg.model.dtype}); hybrid sleep level "
        f"{cfg.trainer.hybrid_sleep_level}"
    )
    levels = sorted({r.get("hybrid/asleep_level") for r in train})
    print(f"hybrid replica's sleep level while the trainer trained (all {len(train)} steps): "
          f"{levels}; replicas lost: {summary['hybrid_lost'] or 'none'}")  # fmt: skip
    print("\n| version | " + " | ".join(name for _, name in KEYS) + " |")
    print("|" + "---|" * (len(KEYS) + 1))
    for r in cycles:
        cells = " | ".join(f"{r.get(k, float('nan')):.3f}" for k, _ in KEYS)
        print(f"| {int(r['step'])} | {cells} |")
    med = statistics.median
    later = cycles[1:] or cycles  # version 0's cycle is the engine's first wake
    print(f"\nmedian over the {len(cycles)} cycles (over the {len(later)} after version 0):")
    for k, name in KEYS:
        print(f"  {name:<18}{med(r.get(k, float('nan')) for r in cycles):9.3f}"
              f"{med(r.get(k, float('nan')) for r in later):9.3f}")  # fmt: skip
    print(
        f"\njob: steps {summary['steps']}, failed groups {summary['counts']['failed']}, wall "
        f"{wall:.0f}s (start-up {summary['startup_s']:.0f}s); val_history "
        f"{summary['val_history']}"
    )

    # Baseline: the raw engine, same model and engine arguments, in this process.
    p = prepare(cfg)
    raw = raw_sleep_wake(str(p.model_dir), engine_kwargs_of(cfg), raw_cycles)
    print(f"\nbaseline: raw vLLM LLM(enable_sleep_mode=True), {raw_cycles} cycles of "
          f"sleep(level=2) -> wake_up(weights) + wake_up(kv_cache), same engine arguments")  # fmt: skip
    for i, r in enumerate(raw):
        print(f"  cycle {i}: freed {r['freed_gb']:.3f} GB (free asleep {r['free_asleep_gb']:.1f}"
              f" GB), sleep {r['sleep_s']:.3f} s, wake {r['wake_s']:.3f} s")  # fmt: skip
    in_job_freed = med(r["hybrid/sleep_freed_gb"] for r in cycles)
    raw_freed = med(r["freed_gb"] for r in raw)
    print(
        f"\nmemory freed per sleep, median: in the job {in_job_freed:.2f} GB (KV release + "
        f"sleep), raw engine {raw_freed:.2f} GB ({in_job_freed / raw_freed:.0%})"
    )
    print(
        f"sleep, median: in the job {med(r['hybrid/sleep_s'] for r in cycles):.3f} s, raw "
        f"{med(r['sleep_s'] for r in raw):.3f} s; wake: in the job "
        f"{med(r['hybrid/wake_s'] for r in cycles):.3f} s (weights; the KV cache wakes in the "
        f"sync), raw {med(r['wake_s'] for r in raw):.3f} s (weights + KV cache)"
    )
    print(
        f"whole cycle around the validation (enter + exit), median: "
        f"{med(r['cost'] for r in cycles):.3f} s, against the raw sleep + wake "
        f"{med(r['sleep_s'] + r['wake_s'] for r in raw):.3f} s"
    )


if __name__ == "__main__":
    main()

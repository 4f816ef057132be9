"""separate_async through the real job on ONE CUDA GPU: the trainer (in the driver) and one
vLLM replica (a Ray actor) share the GPU, the replica taking
`rollout.engine_kwargs.gpu_memory_utilization` of its memory (`runtime.share_trainer_gpu`);
weights travel by `cuda_ipc`. Prints the validation reward per weight version against
version 0, the step timeline (generate wait, old log-probs, train, sync), tokens/s, the
trainer and rollout idle fractions, and an estimate of the trainer's MFU
(6 x params x trained tokens / train seconds / the GPU's dense bf16 peak).

    python benchmarks/gpu_separate_async.py [--qwen05] [key=value ...]

No flag: the default task and tiny model (warm start included), model.dtype float32.
`--qwen05`: a random Qwen2-0.5B-shaped model (bf16, no warm start) on the same task, for
the timeline at a realistic size.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# One GPU: the replica gets it through Ray, the trainer shares it; cuda_ipc between them.
GPU_OVERRIDES = [
    "resources.device=cuda",
    "resources.devices_per_node=2",  # the trainer's device is counted; one GPU holds both
    "resources.trainer_devices=1",
    "resources.rollout_devices=1",
    "runtime.share_trainer_gpu=true",
    "rollout.engine_kwargs.gpu_memory_utilization=0.3",
    "runtime.rollout_num_gpus=1",
    "runtime.rollout_num_cpus=2",
    "runtime.ray_num_cpus=8",
    "runtime.trainer_cpus=[]",
    "runtime.rollout_cpus=[]",
    "runtime.trainer_threads=4",
    "runtime.ckpt_backend=cuda_ipc",
    "runtime.rollout_env={VLLM_LOGGING_LEVEL: WARNING}",
    "runtime.progress_bar=false",
    "trainer.loggers=[console,jsonl]",
]
H200_BF16_DENSE_FLOPS = 989e12
QWEN05 = [
    "model.dtype=bfloat16",
    "rollout.max_tokens=64",
    "rollout.engine_kwargs.max_model_len=256",
    "actor.lr=1e-6",
    "actor.ppo_micro_batch_size_per_device=64",
    "trainer.total_training_steps=12",
    "trainer.test_freq=6",
]


def build_qwen05() -> Path:
    from offbeat.core.models import build_tiny_model

    return build_tiny_model(
        Path(tempfile.gettempdir()) / "offbeat-qwen05", "tiny", seed=0, initializer_range=0.02,
        dtype="bfloat16", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True,
    )  # fmt: skip


def n_params(model_dir: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in m.parameters())


def main() -> None:
    import torch

    from offbeat.core.cli import load_recipe_config
    from offbeat.rollout_vllm.replica import register

    register()  # also where the packages are on PYTHONPATH only (no entry points)

    args = sys.argv[1:]
    extra = []
    if "--qwen05" in args:
        args.remove("--qwen05")
        extra = [f"model.path={build_qwen05()}", *QWEN05]
    module, cfg = load_recipe_config("separate_async", [*GPU_OVERRIDES, *extra, *args])
    t0 = time.perf_counter()
    summary = asyncio.run(module.run_job(cfg))
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in Path(summary["metrics"]).read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    val = [r for r in rows if "val/reward" in r]
    props = torch.cuda.get_device_properties(0)
    print(
        f"\nGPU: {props.name} ({props.total_memory / 2**30:.0f} GiB), one GPU shared by the "
        f"trainer and the replica; model {cfg.model.path} ({cfg.model.dtype})"
    )
    base = val[0]["val/reward"] if val else float("nan")
    print("\n| weight version | validation reward (greedy) | vs version 0 |\n|---|---|---|")
    for r in val:
        print(f"| {int(r['step'])} | {r['val/reward']:.3f} | {r['val/reward'] - base:+.3f} |")
    keys = [
        "timing/step_s", "timing/generate_wait_s", "timing/old_log_prob_s", "timing/train_s",
        "timing/sync_s", "perf/tokens_per_s", "perf/trainer_idle_frac", "perf/rollout_idle_frac",
        "reward/mean",
    ]  # fmt: skip
    print("\n| step | " + " | ".join(k.split("/")[1] for k in keys) + " |")
    print("|" + "---|" * (len(keys) + 1))
    for r in train:
        print(
            f"| {int(r['step'])} | "
            + " | ".join(f"{r.get(k, float('nan')):.3f}" for k in keys)
            + " |"
        )
    later = train[1:] or train
    med = statistics.median
    tiny = cfg.model.path.startswith("offbeat-tiny")
    params = None if tiny else n_params(cfg.model.path)
    print(f"\nmedian over steps 2-{len(train)}:")
    for k in keys[:-1]:
        print(f"  {k:<26}{med(r.get(k, float('nan')) for r in later):.3f}")
    if params:
        # Generated tokens per step (perf/tokens_per_s x step_s): the prompts' tokens are
        # left out, so this is a lower bound.
        tok = [r["perf/tokens_per_s"] * r["timing/step_s"] for r in later]
        mfu = [6 * params * t / r["timing/train_s"] / H200_BF16_DENSE_FLOPS
               for t, r in zip(tok, later, strict=True) if r["timing/train_s"] > 0]  # fmt: skip
        print(
            f"  trainer MFU (lower bound, {params / 1e6:.0f}M params, generated tokens only, "
            f"989 TFLOP/s peak): {med(mfu):.2%}"
        )
    print(
        f"\nsteps {summary['steps']}, failed groups {summary['counts']['failed']}, wall "
        f"{wall:.0f}s (start-up {summary['startup_s']:.0f}s); val_history {summary['val_history']}"
    )


if __name__ == "__main__":
    main()

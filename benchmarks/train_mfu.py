"""Figure: FSDP2 training throughput and MFU of a ~1B-parameter Qwen2-shaped model (random
init, bf16 compute, sequences of 2048 tokens) on 1 and 2 GPUs, beside a plain torch + HF
transformers baseline on one GPU and a large bf16 matmul, all measured in the same run.

    PYTHONPATH=packages/core/src:packages/ckpt_engine/src:packages/balancer/src \
        python benchmarks/train_mfu.py [--steps 8] [--only baseline,fsdp2-1,...]

Each configuration runs in its own process (torchrun for the FSDP2 ones), times `--steps`
optimizer steps after `--warmup` and reports the median. tokens/s counts every token of
the batch (all ranks); TFLOP/s per device is `offbeat.core.train.flops` (verl's count:
6 x N x tokens + the causal attention term, N counting the embedding and the LM head) for
every row, so the rows compare; the FSDP2 rows also print the engine's own
`perf/tflops_per_device` metric. Baseline: HF `Qwen2ForCausalLM` in bf16 (params,
grads and AdamW states), SDPA attention, `loss = model(ids, labels=ids).loss`, fused AdamW,
the whole 8 x 2048 batch in one forward. offbeat: `FSDP2TrainEngine` (float32 master
weights, bf16 compute, float32 gradient reduction) running a PPO update (`PPOLoss`) on
rows whose every position but the first is a response token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SEQ = 2048
# ~1.04B parameters with tied embeddings (the vocabulary of Qwen2 / Qwen2.5).
MODEL = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5376,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}

# name -> (kind, processes, rows per rank, FSDP2Config overrides)
CONFIGS = {
    "baseline": ("baseline", 1, 8, {}),
    "fsdp2-1-plain": (
        "fsdp2",
        1,
        8,
        {"fused_log_probs": False, "compile": False, "reshard_after_forward": True},
    ),
    # The fused head (its passes compiled on a GPU), the layers eager.
    "fsdp2-1-fused": ("fsdp2", 1, 8, {"fused_log_probs": True, "compile": False}),
    # The layers compiled, the plain head.
    "fsdp2-1-compiled-plain": ("fsdp2", 1, 8, {"fused_log_probs": False, "compile": True}),
    "fsdp2-1": ("fsdp2", 1, 8, {"fused_log_probs": True, "compile": True}),
    "fsdp2-2": ("fsdp2", 2, 8, {"fused_log_probs": True, "compile": True}),
    "fsdp2-2-global8": ("fsdp2", 2, 4, {"fused_log_probs": True, "compile": True}),
}


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(**MODEL, attn_implementation="sdpa")


def sync_time() -> float:
    import torch

    torch.cuda.synchronize()
    return time.perf_counter()


def report(payload: dict) -> None:
    print("RESULT " + json.dumps(payload), flush=True)


# ---------------------------------------------------------------------------- workers
def worker_matmul(args) -> None:
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(20):
        t0 = sync_time()
        a @ b
        times.append(sync_time() - t0)
    report(
        {
            "tflops": 2 * n**3 / statistics.median(times) / 1e12,
            "device": torch.cuda.get_device_name(),
        }
    )


def worker_baseline(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from offbeat.core.train.flops import DecoderShape, training_flops

    rows = args.rows
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(qwen2_config(), dtype=torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, MODEL["vocab_size"], (rows, SEQ), device="cuda")
    times = []
    for i in range(args.warmup + args.steps):
        t0 = sync_time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = sync_time() - t0
        if i >= args.warmup:
            times.append(dt)
    flops = training_flops(DecoderShape.from_hf_config(model.config), [SEQ] * rows)
    report(
        {
            "params": sum(p.numel() for p in model.parameters()),
            "step_s": times,
            "tokens": rows * SEQ,
            "flops": flops,
            "devices": 1,
            "max_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
        }
    )


def worker_fsdp2(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from offbeat.core.train import FSDP2Config, FSDP2TrainEngine, OptimConfig, PPOLoss
    from offbeat.core.train.flops import DecoderShape, training_flops

    overrides = json.loads(args.overrides)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(qwen2_config(), dtype=torch.float32)
    config = FSDP2Config(
        device="cuda",
        micro_batch_size=args.rows,
        param_dtype="bfloat16",
        reduce_dtype="float32",
        export_dtype="bfloat16",
        **{"reshard_after_forward": False, **overrides},
        optim=OptimConfig(lr=1e-6, weight_decay=0.0, grad_clip=1.0),
    )
    engine = FSDP2TrainEngine(config, loss_fn=PPOLoss(), model=model)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    rows = args.rows
    batch = {
        "input_ids": torch.randint(0, MODEL["vocab_size"], (rows, SEQ), generator=g),
        "attention_mask": torch.ones(rows, SEQ, dtype=torch.long),
        "response_mask": torch.ones(rows, SEQ - 1),
        "advantages": torch.randn(rows, SEQ - 1, generator=g),
    }
    batch["old_log_probs"] = engine.compute_log_probs(batch)
    times, metrics = [], []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = sync_time()
        m = engine.update(batch)
        dt = sync_time() - t0
        if i >= args.warmup:
            times.append(dt)
            metrics.append(m)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 1e9], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        shape = DecoderShape.from_hf_config(engine.model.config)
        report(
            {
                "params": sum(p.numel() for p in engine.model.parameters()),
                "step_s": times,
                "tokens": rows * SEQ * world,
                "flops": training_flops(shape, [SEQ] * rows * world),
                "devices": world,
                "engine_tflops": statistics.median(m["perf/tflops_per_device"] for m in metrics),
                "engine_mfu": statistics.median(m.get("perf/mfu", 0.0) for m in metrics),
                "max_memory_gb": float(peak),
                "loss": metrics[-1]["actor/loss"],
            }
        )
    dist.destroy_process_group()


WORKERS = {"matmul": worker_matmul, "baseline": worker_baseline, "fsdp2": worker_fsdp2}


# ---------------------------------------------------------------------------- driver
def run_worker(kind: str, procs: int, rows: int, overrides: dict, args) -> dict:
    common = [
        __file__, "--worker", kind, "--rows", str(rows), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--overrides", json.dumps(overrides),
    ]  # fmt: skip
    if kind == "fsdp2":
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={procs}", *common,
        ]  # fmt: skip
    else:
        cmd = [sys.executable, *common]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout[-1500:] + "\n" + proc.stderr[-3000:]).strip()
        return {"error": f"rc={proc.returncode}: {tail}"}
    out = json.loads(lines[-1][len("RESULT ") :])
    out["wall_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=sorted(WORKERS))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--overrides", default="{}")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--only", default=",".join(CONFIGS))
    args = ap.parse_args()
    if args.worker:
        WORKERS[args.worker](args)
        return

    import torch

    gpus = torch.cuda.device_count()
    load = os.getloadavg()
    print(f"# train_mfu: Qwen2-shaped {MODEL}, seq {SEQ}; {gpus} GPUs, torch {torch.__version__}")
    print(f"# {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    mm = run_worker("matmul", 1, 0, {}, args)
    if "error" in mm:
        print("matmul failed:", mm["error"])
        return
    print(f"bf16 8192^3 matmul on {mm['device']}: {mm['tflops']:.0f} TFLOP/s (median of 20)")
    vendor = 989.0
    print()
    head = "| config | GPUs | rows/rank | tokens/s (median of {n}) | vs baseline | TFLOP/s/GPU | MFU of {v:.0f} | of matmul | engine perf/tflops_per_device | peak mem GB |"
    print(head.format(n=args.steps, v=vendor))
    print("|---|---|---|---|---|---|---|---|---|---|")
    base_tps = None
    for name in args.only.split(","):
        kind, procs, rows, overrides = CONFIGS[name]
        if procs > gpus:
            print(f"| {name} | {procs} | {rows} | not run: {gpus} GPU(s) here | | | | | | |")
            continue
        r = run_worker(kind, procs, rows, overrides, args)
        if "error" in r:
            print(f"| {name} | {procs} | {rows} | FAILED | | | | | | |")
            print("```\n" + r["error"][-2500:] + "\n```")
            continue
        step = statistics.median(r["step_s"])
        tps = r["tokens"] / step
        if kind == "baseline":
            base_tps = tps
        tflops = r["flops"] / step / r["devices"] / 1e12
        ratio = f"{tps / base_tps:.2f}x" if base_tps else "-"
        engine = f"{r['engine_tflops']:.0f}" if "engine_tflops" in r else "-"
        print(
            f"| {name} | {r['devices']} | {rows} | {tps / 1e3:.1f}k | {ratio} | {tflops:.0f} | "
            f"{tflops / vendor:.1%} | {tflops / mm['tflops']:.1%} | {engine} | "
            f"{r['max_memory_gb']:.1f} |",
            flush=True,
        )
        print(
            f"<!-- {name}: params {r['params'] / 1e9:.3f}B, steps {[round(s, 4) for s in r['step_s']]}, "
            f"process wall {r['wall_s']:.0f}s, overrides {overrides} -->",
            flush=True,
        )
    print()
    print("tokens/s = every token of the step's batch over all ranks / step wall time;")
    print("TFLOP/s/GPU = offbeat.core.train.flops (verl's count) / step time / GPUs.")


if __name__ == "__main__":
    main()

"""Figures: the Megatron engine against the FSDP2 engine, measured in one run.

1. Training throughput and MFU of a ~1B Qwen2-shaped model (bf16 compute, sequences of
   2048 tokens, the PPO update of `PPOLoss`): Megatron on 1 GPU against FSDP2 on 1 GPU,
   then Megatron TP=2 against FSDP2 DP=2 on 2 GPUs (same global batch: 8 rows).
2. Export into a receiver for a 7B-shaped Qwen2 (bf16): the Megatron engine at TP=2
   against the FSDP2 engine at DP=2, each streaming `export_weights()` through a
   `CheckpointEngineManager` (`naive` backend) into a pre-allocated bf16 model on GPU 0.

    PYTHONPATH=packages/core/src:packages/ckpt_engine/src:packages/balancer/src:\
packages/backend_megatron/src:$MEGATRON python benchmarks/train_megatron.py [--part train|export]

`--shape tiny --device cpu` runs the same code on a CPU in seconds (a smoke run, not a
figure). Each row is its own torchrun process group; the HF checkpoints (random init,
bf16) are written once under `--workdir`. Time per update is the median of `--steps`
after `--warmup`; tokens/s counts every token of the global batch; TFLOP/s per GPU and MFU
are the engines' own `perf/` metrics (`offbeat.core.train.flops`, verl's count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {
    "1b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5376, num_hidden_layers=16,
               num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
}  # fmt: skip
# name -> (engine, processes, TP, rows per rank)
TRAIN_ROWS = {
    "fsdp2-1": ("fsdp2", 1, 1, 8),
    "megatron-1": ("megatron", 1, 1, 8),
    "fsdp2-dp2": ("fsdp2", 2, 1, 4),
    "megatron-tp2": ("megatron", 2, 2, 8),
}
EXPORT_ROWS = {"fsdp2-dp2": ("fsdp2", 2, 1, 0), "megatron-tp2": ("megatron", 2, 2, 0)}


def report(payload: dict) -> None:
    print("RESULT " + json.dumps(payload), flush=True)


def checkpoint(workdir: str, shape: str) -> str:
    """A random-init HF Qwen2 checkpoint of `shape` in bf16 (written once)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = os.path.join(workdir, f"qwen2-{shape}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path + ".tmp", max_shard_size="5GB")
    os.rename(path + ".tmp", path)
    return path


def build(args, *, export: bool):
    from offbeat.core.train import FSDP2Config, FSDP2TrainEngine, OptimConfig, PPOLoss

    optim = OptimConfig(lr=1e-6, weight_decay=0.0, grad_clip=1.0)
    if args.engine == "megatron":
        from offbeat.backend_megatron import MegatronConfig, MegatronTrainEngine

        config = MegatronConfig(
            model_path=args.model, device=args.device, micro_batch_size=max(args.rows, 1),
            # CPU smoke runs take the torch optimizer path, whose masters are the params.
            param_dtype="bfloat16" if args.device == "cuda" else "float32",
            export_dtype="bfloat16", tensor_model_parallel_size=args.tp,
            optimizer="auto", optim=optim,
        )  # fmt: skip
        return MegatronTrainEngine(config, loss_fn=PPOLoss())
    on_gpu = args.device == "cuda"
    config = FSDP2Config(
        model_path=args.model, device=args.device, micro_batch_size=max(args.rows, 1),
        param_dtype="bfloat16", export_dtype="bfloat16", fused_log_probs=True,
        compile=on_gpu and not export, reshard_after_forward=False, optim=optim,
    )  # fmt: skip
    return FSDP2TrainEngine(config, loss_fn=PPOLoss())


def sync_time(device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def worker_train(args) -> None:
    import torch
    import torch.distributed as dist

    engine = build(args, export=False)
    vocab = SHAPES[args.shape]["vocab_size"]
    g = torch.Generator().manual_seed(engine.dp_rank)
    rows, seq = args.rows, args.seq
    batch = {
        "input_ids": torch.randint(0, vocab, (rows, seq), generator=g),
        "attention_mask": torch.ones(rows, seq, dtype=torch.long),
        "response_mask": torch.ones(rows, seq - 1),
        "advantages": torch.randn(rows, seq - 1, generator=g),
    }
    batch["old_log_probs"] = engine.compute_log_probs(batch)
    times, metrics = [], []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = sync_time(args.device)
        m = engine.update(batch)
        dt = sync_time(args.device) - t0
        if i >= args.warmup:
            times.append(dt)
            metrics.append(m)
    if dist.get_rank() == 0:
        report(
            {
                "step_s": times,
                "tokens": rows * seq * engine.dp_size,
                "tflops": statistics.median(m.get("perf/tflops_per_device", 0.0) for m in metrics),
                "mfu": statistics.median(m.get("perf/mfu", 0.0) for m in metrics),
                "max_memory_gb": max(m["actor/max_memory_gb"] for m in metrics),
                "loss": metrics[-1]["actor/loss"],
            }
        )
    dist.destroy_process_group()


class _Receiver:
    """An in-process SyncTarget holding a pre-allocated bf16 model (the rollout side)."""

    def __init__(self, shapes: dict, device: str) -> None:
        import torch

        self.model = {
            n: torch.empty(s, dtype=torch.bfloat16, device=device) for n, s in shapes.items()
        }
        self.version, self.seen = 0, set()

    @property
    def weight_version(self) -> int:
        return self.version

    async def abort_all(self) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def resume(self) -> None: ...

    def _load(self, pairs) -> None:
        for name, t in pairs:
            self.model[name].copy_(t)
            self.seen.add(name)

    async def update_weights(self, spec) -> int:
        from offbeat.ckpt_engine import receive

        self.version = await asyncio.to_thread(receive, spec, self._load, self.version)
        return self.version


def worker_export(args) -> None:
    import torch.distributed as dist
    from safetensors import safe_open

    from offbeat.ckpt_engine import CheckpointEngineManager

    engine = build(args, export=True)
    rank = dist.get_rank()
    times = []
    if rank == 0:
        with open(os.path.join(args.model, "config.json")) as f:
            tied = json.load(f).get("tie_word_embeddings", False)
        shapes = {}
        for file in sorted(os.listdir(args.model)):
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(args.model, file), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                        if not (tied and name == "lm_head.weight"):
                            shapes[name] = tuple(f.get_slice(name).get_shape())
        receiver = _Receiver(shapes, args.device)
        manager = CheckpointEngineManager("naive", phase_timeout_s=600)
        manager.add_target("receiver", receiver)
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = sync_time(args.device)
        if rank == 0:
            result = asyncio.run(manager.sync(engine.export_weights, version=i + 1))
            assert result.succeeded == ["receiver"], result.failed
        else:
            for _ in engine.export_weights():
                pass
        dt = sync_time(args.device) - t0
        if i >= args.warmup:
            times.append(dt)
    if rank == 0:
        assert receiver.seen == set(shapes), sorted(set(shapes) ^ receiver.seen)[:5]
        gb = sum(t.numel() * 2 for t in receiver.model.values()) / 1e9
        report({"step_s": times, "gb": gb, "params": len(shapes)})
    dist.destroy_process_group()


def run_worker(kind: str, name: str, spec: tuple, model: str, args) -> dict:
    engine, procs, tp, rows = spec
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
        __file__, "--worker", kind, "--engine", engine, "--tp", str(tp), "--rows", str(rows),
        "--model", model, "--shape", args.shape if kind == "train" else args.export_shape,
        "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--seq", str(args.seq),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"rc={proc.returncode}: " + (proc.stdout[-1500:] + proc.stderr[-3000:])}
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=("train", "export"))
    ap.add_argument("--part", default="train,export")
    ap.add_argument("--only", default="", help="comma-separated row names (default: all)")
    ap.add_argument("--engine", default="megatron")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--export-shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--model", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--workdir", default=os.path.join("/tmp", "offbeat_megatron_bench"))
    args = ap.parse_args()
    if args.worker:
        {"train": worker_train, "export": worker_export}[args.worker](args)
        return
    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    load = os.getloadavg()
    print(f"# train_megatron: {gpus} devices ({args.device}), torch {torch.__version__}")
    print(f"# load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    os.makedirs(args.workdir, exist_ok=True)
    if "train" in args.part:
        model = checkpoint(args.workdir, args.shape)
        print(f"\n## train: Qwen2 {args.shape} {SHAPES[args.shape]}, seq {args.seq}, bf16\n")
        print(
            f"| row | GPUs | rows/rank | update s (median of {args.steps}) | tokens/s | vs FSDP2 | TFLOP/s/GPU | MFU | peak mem GB |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        base: dict[int, float] = {}
        for name, spec in TRAIN_ROWS.items():
            if args.only and name not in args.only.split(","):
                continue
            if spec[1] > gpus:
                print(f"| {name} | {spec[1]} | {spec[3]} | not run: {gpus} device(s) | | | | | |")
                continue
            r = run_worker("train", name, spec, model, args)
            if "error" in r:
                print(
                    f"| {name} | {spec[1]} | {spec[3]} | FAILED | | | | | |\n```\n{r['error'][-2500:]}\n```"
                )
                continue
            step = statistics.median(r["step_s"])
            tps = r["tokens"] / step
            if spec[0] == "fsdp2":
                base[spec[1]] = tps
            ratio = f"{tps / base[spec[1]]:.2f}x" if spec[1] in base and spec[0] != "fsdp2" else "-"
            print(
                f"| {name} | {spec[1]} | {spec[3]} | {step:.3f} | {tps / 1e3:.1f}k | {ratio} | "
                f"{r['tflops']:.0f} | {r['mfu']:.1%} | {r['max_memory_gb']:.1f} |",
                flush=True,
            )
            print(
                f"<!-- {name}: steps {[round(s, 4) for s in r['step_s']]}, loss {r['loss']:.4f} -->"
            )
    if "export" in args.part:
        model = checkpoint(args.workdir, args.export_shape)
        print(f"\n## export: Qwen2 {args.export_shape} into a receiver on GPU 0 (bf16)\n")
        print(
            f"| row | GPUs | export -> receiver s (median of {args.steps}) | GB | GB/s | vs FSDP2 |"
        )
        print("|---|---|---|---|---|---|")
        base_s = None
        for name, spec in EXPORT_ROWS.items():
            if args.only and name not in args.only.split(","):
                continue
            if spec[1] > gpus:
                print(f"| {name} | {spec[1]} | not run: {gpus} device(s) | | | |")
                continue
            r = run_worker("export", name, spec, model, args)
            if "error" in r:
                print(f"| {name} | {spec[1]} | FAILED | | | |\n```\n{r['error'][-2500:]}\n```")
                continue
            s = statistics.median(r["step_s"])
            base_s = s if spec[0] == "fsdp2" else base_s
            ratio = f"{base_s / s:.2f}x faster" if base_s and spec[0] != "fsdp2" else "-"
            print(
                f"| {name} | {spec[1]} | {s:.3f} | {r['gb']:.2f} | {r['gb'] / s:.1f} | {ratio} |",
                flush=True,
            )
            print(
                f"<!-- {name}: {r['params']} tensors, syncs {[round(x, 4) for x in r['step_s']]} -->"
            )


if __name__ == "__main__":
    main()

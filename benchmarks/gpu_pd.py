"""Time to first token and decode speed of a prefill-decode (PD) replica against one plain
engine on the same devices, with many concurrent long-prompt requests, on a CUDA GPU with
real vLLM. The model is a random Qwen2-0.5B-shaped one (gpu_figures.py's `qwen05`, bf16,
eager).

On one GPU the PD replica is one P engine and one D engine splitting the GPU's memory
(`--mem` each; the single engine gets 2 x `--mem`), the KV handed over by the shared-storage
connector through /dev/shm. Both are driven the same way: every request sent at once, its
first-token time read from vLLM's request stats (when the first token reached the server's
process), so TTFT = that - the call's start; per-request decode speed = (tokens - 1) /
(done - first token); and the aggregate output tokens / makespan.

    python benchmarks/gpu_pd.py [--requests 256 1024] [--prompt-len 1024] [--max-tokens 128]
        [--mem 0.4] [--only single|pd]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

from gpu_figures import build_qwen05, gpu_line, pct


def engine_kwargs(mem: float, max_num_seqs: int, max_model_len: int) -> dict:
    return {
        "max_model_len": max_model_len,
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_num_seqs": max_num_seqs,
        "gpu_memory_utilization": mem,
        "seed": 0,
    }


async def drive(server, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}

    async def one(i: int, p: list[int]):
        t0 = time.time()
        out = await server.generate(f"{tag}-{i}", p, params)
        return t0, out, time.time()

    t0 = time.time()
    rows = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    makespan = time.time() - t0
    ttft = [o.extra["first_token_time"] - s for s, o, _ in rows]
    decode = [
        (len(o.token_ids) - 1) / max(1e-9, e - o.extra["first_token_time"]) for _, o, e in rows
    ]
    tokens = sum(len(o.token_ids) for _, o, _ in rows)
    assert all(len(o.token_ids) == max_tokens for _, o, _ in rows)
    return {
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p90": pct(ttft, 0.9),
        "ttft_p99": pct(ttft, 0.99),
        "decode_tok_s_req": statistics.median(decode),
        "out_tok_s": tokens / makespan,
        "makespan_s": makespan,
        "loaded": statistics.median(o.extra.get("num_cached_tokens", 0) for _, o, _ in rows),
    }


async def bench(kind: str, args, model: Path, prompts_by_n: dict[int, list]) -> dict:
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig
    from offbeat.rollout_vllm.pd import pd_servers

    seqs = max(args.requests)
    kw = engine_kwargs(args.mem, seqs, args.prompt_len + args.max_tokens + 16)
    t0 = time.perf_counter()
    storage = None
    if kind == "single":
        kw["gpu_memory_utilization"] = 2 * args.mem
        server = VLLMRolloutServer(
            VLLMServerConfig(model=str(model), engine_kwargs=kw, server_id="single")
        )
    else:
        root = os.environ.get("OFFBEAT_PD_STORAGE", "/dev/shm")
        storage = os.path.join(root, f"offbeat-pd-bench-{os.getpid()}")
        server = pd_servers(str(model), kw, storage, server_id="pd")
    start_s = time.perf_counter() - t0
    out = {"start_s": start_s}
    try:
        await drive(server, prompts_by_n[min(args.requests)][:32], args.max_tokens, "warm")
        for n in args.requests:
            r = await drive(server, prompts_by_n[n], args.max_tokens, f"{kind}{n}")
            r["load"] = os.getloadavg()
            out[n] = r
            print(f"{kind} {n} requests: {r}", flush=True)
    finally:
        server.shutdown()
        if storage:
            shutil.rmtree(storage, ignore_errors=True)
    return out


async def main_async(args) -> None:
    root = Path(tempfile.mkdtemp(prefix="gpupd-"))
    model = build_qwen05(root)
    rng = random.Random(0)
    # Distinct random prompts (byte vocab 260), one set per concurrency.
    prompts_by_n = {
        n: [[rng.randrange(3, 259) for _ in range(args.prompt_len)] for _ in range(n)]
        for n in args.requests
    }
    kinds = [args.only] if args.only else ["single", "pd"]
    results = {}
    try:
        for kind in kinds:
            results[kind] = await bench(kind, args, model, prompts_by_n)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    print(f"GPU: {gpu_line()}")
    print(
        f"model: random Qwen2-0.5B-shaped (bf16, eager, byte vocab); {args.prompt_len}-token "
        f"prompts (distinct, random) x {args.max_tokens} new tokens, greedy, ignore_eos, all "
        f"sent at once; PD: 1 P + 1 D engine at gpu_memory_utilization {args.mem} each on the "
        f"one GPU, KV through vLLM's shared-storage example connector (/dev/shm); single "
        f"engine: {2 * args.mem}"
    )
    head = (
        f"{'replica':<8}{'requests':>9}{'TTFT p50 s':>11}{'p90 s':>8}{'p99 s':>8}"
        f"{'decode tok/s/req':>17}{'output tok/s':>13}{'makespan s':>11}{'loaded':>7}"
    )
    print(head)
    for n in args.requests:
        for kind in kinds:
            r = results[kind][n]
            print(
                f"{kind:<8}{n:>9}{r['ttft_p50']:>11.2f}{r['ttft_p90']:>8.2f}{r['ttft_p99']:>8.2f}"
                f"{r['decode_tok_s_req']:>17.1f}{r['out_tok_s']:>13.0f}{r['makespan_s']:>11.2f}"
                f"{r['loaded']:>7.0f}"
            )
    if len(kinds) == 2:
        for n in args.requests:
            s, p = results["single"][n], results["pd"][n]
            print(
                f"{n} requests: PD / single TTFT p50 {p['ttft_p50'] / s['ttft_p50']:.2f}x, "
                f"decode tok/s per request {p['decode_tok_s_req'] / s['decode_tok_s_req']:.2f}x, "
                f"output tok/s {p['out_tok_s'] / s['out_tok_s']:.2f}x"
            )
    print(
        "engine start: "
        + ", ".join(f"{k} {v['start_s']:.1f}s" for k, v in results.items())
        + f"; load average at the end {os.getloadavg()}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--mem", type=float, default=0.4)
    ap.add_argument("--only", choices=["single", "pd"], default=None)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()

"""The GPU figures of offbeat-rollout-vllm on one CUDA GPU with real vLLM, each printed beside
its baseline measured in the same run. Random-init Qwen2-shaped models are built here from a
config (no hub): `qwen05` (Qwen2-0.5B's layers and heads, offbeat's 260-token byte vocab),
and the 1.5B / 7B shapes (Qwen2.5-1.5B / -7B, their real 151,936 / 152,064 vocab) loaded by
vLLM with `load_format=dummy`.

  throughput  offbeat's full path (PartialRolloutClient -> AsyncLoadBalancer -> Ray actor ->
              VLLMRolloutServer -> vLLM) against vLLM's own `AsyncLLM.generate` in this
              process, same GPU, model, prompts and engine arguments; alternating runs
              (reuses benchmarks/rollout_throughput.py's runners).
  abort       abort_all() -> every request generating again, with N requests in flight
              (reuses benchmarks/rollout_abort_latency.py's round), against the raw re-prefill
              of the same sequences; p50 / p99 over rounds.
  weightsync  a weight sync by `cuda_ipc` from this process (the trainer's bf16 tensors on the
              GPU) into a real engine, per phase, the engine's own work included; against a
              device-to-device copy of the same bytes. Variants, interleaved sync by sync:
              every tensor through vLLM's `load_weights` with the KV cache released (the
              old path), the direct copy into the parameters with it released, and the
              direct copy keeping the KV cache (`release_kv=False`). Then the sleep/wake cost of
              a hybrid validation cycle on the same engine: sleep(1) / wake, and sleep(2) /
              wake weights / reload by cuda_ipc / wake KV, with the memory each sleep frees;
              against the engine's cold start, measured in the same run.

    python benchmarks/gpu_figures.py throughput [--prompts 512] [--max-tokens 256] [--repeats 5]
    python benchmarks/gpu_figures.py abort [--requests 512] [--rounds 10] [--profile]
    python benchmarks/gpu_figures.py weightsync [--shapes 1.5b 7b] [--syncs 5] [--cycles 3]
        [--variants load_weights+kv direct+kv direct] [--bucket-mb MB [MB ...]]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # CUDA is touched here first

GB = 1e9
GIB = 1 << 30
MED = statistics.median

# Qwen2-0.5B's decoder (vocab: offbeat's byte tokenizer); Qwen2.5-1.5B and -7B in full.
QWEN05 = dict(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, tie_word_embeddings=True,
)  # fmt: skip
SHAPES = {
    "1.5b": dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
    ),
}  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs) + 0.5) - 1))]


def gpu_line() -> str:
    import torch

    from offbeat.rollout_vllm import compat

    p = torch.cuda.get_device_properties(0)
    return (
        f"{p.name} ({p.total_memory / GIB:.0f} GiB), vLLM {compat.VLLM_VERSION}, torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs"
    )


def build_qwen05(root: Path) -> Path:
    from offbeat.core.models import build_tiny_model

    return build_tiny_model(
        root / "qwen05", "tiny", seed=0, initializer_range=0.02, dtype="bfloat16", **QWEN05
    )


def n_params(model_dir: Path) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in m.parameters())


def engine_kwargs(mem: float, max_num_seqs: int, max_model_len: int = 512, **extra) -> dict:
    return {
        "max_model_len": max_model_len,
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max(8192, max_num_seqs * 16),
        "gpu_memory_utilization": mem,
        "disable_log_stats": True,
        "seed": 0,
        **extra,
    }


# ---- throughput -----------------------------------------------------------------------
async def throughput(args: argparse.Namespace) -> None:
    import ray
    from rollout_throughput import make_prompts, run_offbeat, run_raw

    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig
    from offbeat.rollout_vllm.actor import RemoteRolloutServer, vllm_server_actor

    root = Path(tempfile.mkdtemp(prefix="gpufig-"))
    model = build_qwen05(root)
    params = n_params(model)
    kw = engine_kwargs(args.mem, args.prompts)
    ray.init(num_gpus=1, num_cpus=8, include_dashboard=False, log_to_driver=True)
    t0 = time.perf_counter()
    handle = vllm_server_actor(
        VLLMServerConfig(model=str(model), engine_kwargs=dict(kw), server_id="actor"),
        num_cpus=2, num_gpus=0.5,
    )  # fmt: skip
    remote = RemoteRolloutServer(handle, weight_version=0)
    await remote.refresh()
    actor_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    local = VLLMRolloutServer(
        VLLMServerConfig(model=str(model), engine_kwargs=dict(kw), server_id="local")
    )
    local_start = time.perf_counter() - t0
    client = PartialRolloutClient(
        AsyncLoadBalancer({"actor": remote}),
        PartialRolloutConfig(max_tokens=args.max_tokens),
    )
    prompts = make_prompts(args.prompts)
    runs: dict[str, list[float]] = {"raw": [], "offbeat": []}
    try:
        await run_raw(local.engine, prompts, args.max_tokens, True, "warm")
        await run_offbeat(client, prompts, args.max_tokens, "warm")
        for r in range(args.repeats):
            pair = [
                ("raw", lambda r=r: run_raw(local.engine, prompts, args.max_tokens, True, f"r{r}")),
                ("offbeat", lambda r=r: run_offbeat(client, prompts, args.max_tokens, f"o{r}")),
            ]
            for name, fn in pair if r % 2 == 0 else pair[::-1]:
                tps, _ = await fn()
                runs[name].append(tps)
                print(f"run {r} {name}: {tps:.0f} tok/s", flush=True)
    finally:
        local.shutdown()
        from offbeat.core.trainer.elastic import shutdown_replicas

        await shutdown_replicas({"actor": remote})
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    ratios = [o / r for o, r in zip(runs["offbeat"], runs["raw"], strict=True)]
    print()
    print(f"GPU: {gpu_line()}")
    print(
        f"model: random Qwen2-0.5B-shaped ({params / 1e6:.0f}M params, byte vocab), "
        f"bf16, enforce_eager, gpu_memory_utilization {args.mem} per engine (both engines up); "
        f"{args.prompts} prompts of 16-64 tokens x {args.max_tokens} new tokens (greedy, "
        f"ignore_eos); {args.repeats} alternating pairs after a warm-up; engine start: Ray "
        f"actor {actor_start:.1f}s, in-process {local_start:.1f}s"
    )
    print(f"{'path':<58}{'median tok/s':>13}{'best tok/s':>12}")
    for label, key in (
        ("vLLM AsyncLLM.generate in this process (baseline)", "raw"),
        ("offbeat: client -> balancer -> Ray actor -> adapter -> vLLM", "offbeat"),
    ):
        print(f"{label:<58}{MED(runs[key]):>13.0f}{max(runs[key]):>12.0f}")
    print(
        f"\noffbeat / AsyncLLM: median of paired runs {MED(ratios):.1%} (target >= 95%); "
        f"paired: " + ", ".join(f"{x:.1%}" for x in ratios)
    )


# ---- abort ----------------------------------------------------------------------------
async def abort(args: argparse.Namespace) -> None:
    import rollout_abort_latency as ral

    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig

    root = Path(tempfile.mkdtemp(prefix="gpufig-"))
    model = build_qwen05(root)
    server = VLLMRolloutServer(
        VLLMServerConfig(
            model=str(model), engine_kwargs=engine_kwargs(args.mem, args.requests), server_id="a"
        )
    )
    client = PartialRolloutClient(
        AsyncLoadBalancer({server.server_id: server}), PartialRolloutConfig(max_tokens=ral.BUDGET)
    )
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(32, 127) for _ in range(32)] for _ in range(args.requests)]
    rounds, base = [], []
    try:
        await ral.one_round(server, client, prompts, "warm")
        if args.profile:
            # Where this process spends one round (abort, resubmission, re-prefill): the
            # functions by their own time, for finding per-request overhead.
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            x = await ral.one_round(server, client, prompts, "prof")
            prof.disable()
            print(
                f"profiled round (slower under the profiler): abort {1e3 * x['abort']:.0f} ms, "
                f"resubmitted {1e3 * x['to_resubmitted']:.0f} ms, generating again "
                f"{1e3 * x['to_generating']:.0f} ms; this process's top functions:"
            )
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        for r in range(args.rounds):
            rounds.append(await ral.one_round(server, client, prompts, f"lat{r}"))
            base.append(await ral.baseline_prefill(server.engine, rounds[-1]["seqs"], f"b{r}"))
            x = rounds[-1]
            print(
                f"round {r}: abort {1e3 * x['abort']:.1f} ms, resume {1e3 * x['resume']:.1f} ms, "
                f"all resubmitted and accepted {1e3 * x['to_resubmitted']:.1f} ms, "
                f"all generating again {1e3 * x['to_generating']:.1f} ms, raw re-prefill "
                f"{1e3 * base[-1]:.1f} ms",
                flush=True,
            )
    finally:
        server.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    print()
    print(f"GPU: {gpu_line()}")
    print(
        f"model: random Qwen2-0.5B-shaped, bf16, enforce_eager; {args.requests} requests in "
        f"flight through client -> balancer -> adapter (in process), 32-token prompts, "
        f"aborted after >= 8 tokens each, budget {ral.BUDGET}; {args.rounds} rounds (ms)"
    )
    rows = [
        ("abort_all() until every call returned 'aborted'", [x["abort"] for x in rounds]),
        ("resume()", [x["resume"] for x in rounds]),
        (
            "abort_all() -> all resubmitted, accepted by the engine",
            [x["to_resubmitted"] for x in rounds],
        ),
        ("abort_all() -> all requests generating again", [x["to_generating"] for x in rounds]),
        ("baseline: raw AsyncLLM re-prefill of the same sequences", base),
    ]
    print(f"  {'':<58}{'p50':>8}{'p99':>8}   rounds")
    for label, xs in rows:
        print(
            f"  {label:<58}{1e3 * MED(xs):>8.1f}{1e3 * pct(xs, 0.99):>8.1f}   "
            + ", ".join(f"{1e3 * x:.0f}" for x in xs)
        )
    print(
        f"  abort -> all resumed (resubmitted, accepted) p99 "
        f"{1e3 * pct([x['to_resubmitted'] for x in rounds], 0.99):.1f} ms (target <= 50 ms)"
    )
    over = [x["to_generating"] - b for x, b in zip(rounds, base, strict=True)]
    print(
        f"  abort -> all generating again p99 {1e3 * pct([x['to_generating'] for x in rounds], 0.99):.1f} ms"
        f" (target <= 50 ms); beyond the re-prefill: median {1e3 * MED(over):.1f} ms"
    )


# ---- weight sync + sleep/wake -----------------------------------------------------------
# Weight-sync variants: (direct_weight_copy, release_kv, what it is).
VARIANTS = {
    "load_weights+kv": (False, True, "every tensor through vLLM's load_weights, KV released (the old path)"),
    "direct+kv": (True, True, "direct copy into the parameters, KV released"),
    "direct": (True, False, "direct copy, KV kept (release_kv=False)"),
}  # fmt: skip


def shaped_model(root: Path, shape: str) -> Path:
    """A model directory of `shape` for `load_format=dummy`: the byte tokenizer of a tiny
    build, a Qwen2 config of that shape, no weights."""
    from offbeat.core.models import build_tiny_model

    tiny = build_tiny_model(root / "tiny", "tiny", dtype="bfloat16")
    out = root / shape
    shutil.copytree(tiny, out)
    for f in out.glob("*.safetensors*"):
        f.unlink()
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("layer_types", None)
    cfg.update(SHAPES[shape])
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    cfg["max_position_embeddings"] = 4096
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def trainer_tensors(model_dir: Path) -> list:
    """The trainer's side: every parameter of the HF model, bf16 on this GPU (tied
    embeddings once, as `named_parameters` gives them)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for name, p in m.named_parameters():
        t = torch.empty(p.shape, dtype=torch.bfloat16, device="cuda")
        t.normal_(0.0, 0.02, generator=g)
        out.append((name, t))
    torch.cuda.synchronize()
    return out


def d2d_copy_s(nbytes: int, repeats: int = 7) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return MED(times)


def free_bytes() -> int:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


async def weightsync_shape(shape: str, args: argparse.Namespace, root: Path) -> dict:
    from offbeat.ckpt_engine import CheckpointEngineManager
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig

    model = shaped_model(root, shape)
    tensors = trainer_tensors(model)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    d2d = d2d_copy_s(nbytes)
    kw = engine_kwargs(args.mem, 16, load_format="dummy")
    t0 = time.perf_counter()
    server = VLLMRolloutServer(
        VLLMServerConfig(model=str(model), engine_kwargs=kw, server_id=shape)
    )
    cold_start = time.perf_counter() - t0
    # One manager per (variant, bucket size): every pair is measured on the same engine.
    runs = {
        (f"{v}@{mb}M" if len(args.bucket_mb) > 1 else v): (v, mb)
        for v in args.variants
        for mb in args.bucket_mb
    }
    managers = {
        label: CheckpointEngineManager(
            "cuda_ipc",
            phase_timeout_s=600,
            release_kv=VARIANTS[v][1],
            bucket_bytes=(mb << 20) if mb else None,
        )
        for label, (v, mb) in runs.items()
    }
    syncs: dict[str, list] = {label: [] for label in runs}
    version, cycles1, cycles2 = 0, [], []
    prompt = list(range(40, 72))
    ids = itertools.count()

    async def probe() -> float:
        """A validation request's worth of work: 8 requests x 16 tokens."""
        t = time.perf_counter()
        await asyncio.gather(
            *(
                server.generate(f"v{next(ids)}", prompt, {"max_tokens": 16, "ignore_eos": True})
                for i in range(8)
            )
        )
        return time.perf_counter() - t

    try:
        # Variants interleaved sync by sync (each its own warm-up first), so drift in the
        # machine's state hits them alike.
        order = [label for _ in range(args.warmup + args.syncs) for label in runs]
        done: dict[str, int] = dict.fromkeys(runs, 0)
        for variant in order:
            server.config.direct_weight_copy = VARIANTS[runs[variant][0]][0]
            version += 1
            t = time.perf_counter()
            res = await managers[variant].sync(tensors, version, {shape: server})
            total = time.perf_counter() - t
            assert res.ok, res.failed
            done[variant] += 1
            w = server.last_update["workers"][0]
            if done[variant] > args.warmup:
                syncs[variant].append((res, total, w))
            print(
                f"{shape} [{variant}] sync {version}{' (warm-up)' if done[variant] <= args.warmup else ''}: "
                f"total {1e3 * total:.1f} ms, phases "
                + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in res.phase_s.items())
                + f" ms, worker {json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in w.items() if k != 'version'})}",
                flush=True,
            )
        await probe()
        server.config.direct_weight_copy = True
        manager = managers[list(runs)[-1]]
        # Hybrid validation cycle, level 1: sleep beside the trainer, wake, validate.
        for c in range(args.cycles):
            awake = free_bytes()
            t = time.perf_counter()
            await server.sleep(1)
            t_sleep = time.perf_counter() - t
            asleep = free_bytes()
            t = time.perf_counter()
            await server.wake_up()
            await server.resume()
            t_wake = time.perf_counter() - t
            t_val = await probe()
            cycles1.append((asleep - awake, t_sleep, t_wake, t_val))
            print(f"{shape} cycle L1 {c}: freed {(asleep - awake) / GIB:.2f} GiB, sleep "
                  f"{t_sleep:.3f}s, wake {t_wake:.3f}s, probe {t_val:.3f}s", flush=True)  # fmt: skip
        # Level 2: the weights are discarded and come back by a weight sync.
        for c in range(args.cycles):
            awake = free_bytes()
            t = time.perf_counter()
            await server.sleep(2)
            t_sleep = time.perf_counter() - t
            asleep = free_bytes()
            t = time.perf_counter()
            await server.wake_up(["weights"])
            t_ww = time.perf_counter() - t
            version += 1
            t = time.perf_counter()
            res = await manager.sync(tensors, version, {shape: server})
            t_reload = time.perf_counter() - t
            assert res.ok, res.failed
            t = time.perf_counter()
            await server.wake_up(["kv_cache"])
            await server.resume()
            t_wk = time.perf_counter() - t
            t_val = await probe()
            cycles2.append((asleep - awake, t_sleep, t_ww, t_reload, t_wk, t_val))
            print(f"{shape} cycle L2 {c}: freed {(asleep - awake) / GIB:.2f} GiB, sleep "
                  f"{t_sleep:.3f}s, wake weights {t_ww:.3f}s, reload {t_reload:.3f}s, wake KV "
                  f"{t_wk:.3f}s, probe {t_val:.3f}s", flush=True)  # fmt: skip
    finally:
        for m in managers.values():
            m.close()
        server.shutdown()
        del tensors
        import torch

        torch.cuda.empty_cache()
    return {
        "shape": shape, "bytes": nbytes, "d2d_s": d2d,
        "syncs": syncs, "cold_start": cold_start, "cycles1": cycles1, "cycles2": cycles2,
    }  # fmt: skip


async def weightsync(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="gpufig-"))
    rows = []
    try:
        for shape in args.shapes:
            rows.append(await weightsync_shape(shape, args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    print(f"GPU: {gpu_line()}")
    print(
        f"engine: vLLM bf16, load_format=dummy, enforce_eager, gpu_memory_utilization "
        f"{args.mem}; trainer: this process, its bf16 tensors on the same GPU; cuda_ipc "
        f"backend, {' / '.join(f'{mb} MiB' if mb else 'default' for mb in args.bucket_mb)} "
        f"buckets; median of "
        f"{args.syncs} syncs after {args.warmup} warm-up"
    )
    print(
        "variants (interleaved in one run, same engine and trainer tensors): "
        + "; ".join(f"{v}: {VARIANTS[v][2]}" for v in args.variants)
    )
    print(
        f"{'shape':<6}{'variant':<22}{'GB':>7}{'buckets':>8}{'abort':>8}{'rel.KV':>8}"
        f"{'transfer':>10}{'res.KV':>8}{'resume':>8}{'total':>8}{'GB/s':>8}{'D2D ms':>8}"
        f"{'D2D GB/s':>9}{'xfer/D2D':>9}{'total/D2D':>10}   (ms)"
    )
    for r in rows:
        for variant, s in r["syncs"].items():
            ph = {k: MED(x[0].phase_s.get(k, 0.0) for x in s) for k in s[0][0].phase_s}
            xfer, total = ph["transfer"], MED(x[1] for x in s)
            d2d_gbps = r["bytes"] / r["d2d_s"] / GB
            print(
                f"{r['shape']:<6}{variant:<22}{r['bytes'] / GB:>7.2f}{s[0][0].buckets:>8}"
                f"{1e3 * ph.get('abort', 0):>8.1f}{1e3 * ph.get('release_kv', 0):>8.1f}"
                f"{1e3 * xfer:>10.1f}{1e3 * ph.get('resume_kv', 0):>8.1f}"
                f"{1e3 * ph.get('resume', 0):>8.1f}{1e3 * total:>8.1f}"
                f"{r['bytes'] / xfer / GB:>8.1f}{1e3 * r['d2d_s']:>8.1f}{d2d_gbps:>9.0f}"
                f"{r['d2d_s'] / xfer:>9.1%}{r['d2d_s'] / total:>10.1%}"
            )
    print("inside the transfer phase, in vLLM's worker (median, ms):")
    for r in rows:
        for variant, s in r["syncs"].items():
            keys = sorted({k for x in s for k, v in x[2].items() if isinstance(v, float)})
            print(
                f"  {r['shape']} {variant}: "
                + ", ".join(f"{k} {1e3 * MED(x[2].get(k, 0.0) for x in s):.1f}" for k in keys)
                + f"; tensors direct/loaded {s[-1][2].get('direct_tensors')}/"
                f"{s[-1][2].get('loaded_tensors')}"
            )
    print(
        f"  (xfer/D2D: the transfer phase's speed as a share of the D2D copy's; total/D2D: the "
        f"whole sync's; target for 7B >= 50%); load average {os.getloadavg()}"
    )
    print("\nhybrid validation cycle on the same engine (median of cycles):")
    for r in rows:
        c1, c2 = r["cycles1"], r["cycles2"]
        if c1:
            print(
                f"  {r['shape']} level 1: sleep frees {MED(x[0] for x in c1) / GIB:.2f} GiB; sleep "
                f"{1e3 * MED(x[1] for x in c1):.0f} ms + wake {1e3 * MED(x[2] for x in c1):.0f} ms"
                f" = {1e3 * MED(x[1] + x[2] for x in c1):.0f} ms per cycle (validation probe "
                f"{1e3 * MED(x[3] for x in c1):.0f} ms)"
            )
        if c2:
            print(
                f"  {r['shape']} level 2: sleep frees {MED(x[0] for x in c2) / GIB:.2f} GiB; sleep "
                f"{1e3 * MED(x[1] for x in c2):.0f} ms + wake weights "
                f"{1e3 * MED(x[2] for x in c2):.0f} ms + reload by cuda_ipc "
                f"{1e3 * MED(x[3] for x in c2):.0f} ms + wake KV {1e3 * MED(x[4] for x in c2):.0f}"
                f" ms = {1e3 * MED(x[1] + x[2] + x[3] + x[4] for x in c2):.0f} ms per cycle"
            )
        print(
            f"  {r['shape']} baseline: a cold engine start (dummy weights) {r['cold_start']:.1f} s"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--prompts", type=int, default=512)
    t.add_argument("--max-tokens", type=int, default=256)
    t.add_argument("--repeats", type=int, default=5)
    t.add_argument("--mem", type=float, default=0.3)
    a = sub.add_parser("abort")
    a.add_argument("--requests", type=int, default=512)
    a.add_argument("--rounds", type=int, default=10)
    a.add_argument("--mem", type=float, default=0.3)
    a.add_argument("--profile", action="store_true", help="also profile one round (cProfile)")
    w = sub.add_parser("weightsync")
    w.add_argument("--shapes", nargs="+", default=["1.5b", "7b"])
    w.add_argument("--syncs", type=int, default=5)
    w.add_argument("--warmup", type=int, default=2)
    w.add_argument("--cycles", type=int, default=3)
    w.add_argument(
        "--bucket-mb", type=int, nargs="+", default=[0],
        help="bucket sizes, each measured on the same engine (0: the backend's)",
    )  # fmt: skip
    w.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    w.add_argument("--mem", type=float, default=0.35)
    args = ap.parse_args()
    asyncio.run(
        {"throughput": throughput, "abort": abort, "weightsync": weightsync}[args.cmd](args)
    )


if __name__ == "__main__":
    main()

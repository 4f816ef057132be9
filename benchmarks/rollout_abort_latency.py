"""Figure 3 of offbeat-rollout-vllm: abort-to-resumed latency; and, with `--job`, the
sync abort under the default job's conditions.

Default mode: N requests decode through PartialRolloutClient -> AsyncLoadBalancer ->
VLLMRolloutServer (in this process). We call `abort_all()` (every in-flight call returns
"aborted" with its tokens), then `resume()`; the client resends prompt + tokens so far with
the remaining budget. Measured: abort_all() until every interrupted call has returned;
resume(); and from abort_all() until every interrupted request has produced its first new
token again ("generating again").
Baseline, same run, same engine: the unavoidable part of a resume, i.e. raw
`AsyncLLM.generate` of the same N (prompt + partial output) sequences on the idle engine,
until each has produced one token (a re-prefill, since the KV cache is dropped with the
weights). Progress is read from vLLM's output processor, which is fine for a benchmark.

Job mode (`--job`): the recipe's replica started as `offbeat run separate_async` starts it
(a Ray actor, the recipe's pinning), `runtime.max_concurrent_groups` x `rollout.n` requests
kept in flight through the job's agent loop, client and balancer, the trainer's cores kept
busy by a process spinning matmuls, and a weight sync of the job's weights (through the
job's ReplicaPool and checkpoint engine) every `--interval` s. Printed per path: p50/p99
of the sync's abort phase and of the whole sync, the median over `--runs` runs of
`--syncs` syncs each, with the requests in flight and the load average. Paths: `new` (this
code) and `old` (the path before the fix, selected by flag: one Ray actor call per sample,
every call straight into vLLM with no admission bound, replica processes unconfined, only
the trainer's main thread pinned).

    python benchmarks/rollout_abort_latency.py [--requests 64] [--repeats 3]
    python benchmarks/rollout_abort_latency.py --job [--paths old,new] [--runs 3]
        [--syncs 10] [--max-tokens 48] [key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BUDGET = 180


def states(engine, prefix: str):
    return [
        s
        for s in engine.output_processor.request_states.values()
        if str(s.external_req_id).startswith(prefix)
    ]


async def wait_for(cond, timeout: float = 120.0) -> float:
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.001)
    return time.perf_counter()


async def one_round(server, client, prompts, tag: str) -> dict:
    engine = server.engine
    params = {"temperature": 0.0, "ignore_eos": True}
    tasks = [
        asyncio.create_task(client.generate(f"{tag}-{i}", p, params)) for i, p in enumerate(prompts)
    ]
    n = len(prompts)
    # Let every request get a few tokens into its decode.
    await wait_for(
        lambda: (
            len(states(engine, tag)) == n
            and all(s.detokenizer.num_output_tokens() >= 8 for s in states(engine, tag))
        )
    )
    t0 = time.perf_counter()
    await server.abort_all()
    t_abort = time.perf_counter()
    await server.resume()
    t_resume = time.perf_counter()

    resumed_seqs: list[list[int]] = []

    def resumed_accepted() -> bool:
        # Every interrupted request sent again and accepted by the engine (AsyncLLM has
        # registered it: it is queued for the engine core), no token asked for yet.
        resumed = [s for s in states(engine, tag) if len(s.prompt_token_ids) > len(prompts[0])]
        return len(resumed) == n

    t_sub = await wait_for(resumed_accepted)

    def resumed_and_generating() -> bool:
        # A resumed attempt's prompt is the original prompt + the tokens kept so far.
        resumed = [s for s in states(engine, tag) if len(s.prompt_token_ids) > len(prompts[0])]
        if len(resumed) == n and all(s.detokenizer.num_output_tokens() >= 1 for s in resumed):
            resumed_seqs[:] = [list(s.prompt_token_ids) for s in resumed]
            return True
        return False

    t_gen = await wait_for(resumed_and_generating)
    outs = await asyncio.gather(*tasks)
    assert all(len(o.token_ids) == BUDGET and o.extra["num_attempts"] == 2 for o in outs)
    return {
        "abort": t_abort - t0,
        "resume": t_resume - t_abort,
        "to_generating": t_gen - t0,
        "to_resubmitted": t_sub - t0,
        "seqs": resumed_seqs,
        "tokens_kept": sum(len(q) - len(prompts[0]) for q in resumed_seqs),
    }


async def baseline_prefill(engine, seqs, tag: str) -> float:
    """Raw AsyncLLM: submit the sequences to the idle engine; seconds until each has one
    new token."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
    )

    async def one(i, s):
        async for _ in engine.generate(TokensPrompt(prompt_token_ids=s), sp, f"{tag}-{i}"):
            pass

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, s) for i, s in enumerate(seqs)))
    return time.perf_counter() - t0


async def main(args: argparse.Namespace) -> None:
    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.core.models import build_tiny_model
    from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig

    server = VLLMRolloutServer(
        VLLMServerConfig(
            model=str(build_tiny_model(size=args.size)),
            engine_kwargs={
                "max_model_len": 256,
                "dtype": "float32",
                "enforce_eager": True,
                "max_num_seqs": max(args.requests, 8),
                "disable_log_stats": True,
            },
        )
    )
    client = PartialRolloutClient(
        AsyncLoadBalancer({server.server_id: server}), PartialRolloutConfig(max_tokens=BUDGET)
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(32, 127) for _ in range(32)] for _ in range(args.requests)]
    rounds, base = [], []
    for r in range(args.repeats):
        rounds.append(await one_round(server, client, prompts, f"lat{r}"))
        base.append(await baseline_prefill(server.engine, rounds[-1]["seqs"], f"base{r}"))
    server.shutdown()

    med = statistics.median
    print()
    print(
        f"tiny random Qwen2 '{args.size}', vLLM-cpu float32, {os.cpu_count()} CPUs (shared; "
        f"load avg {os.getloadavg()[0]:.1f}); {args.requests} requests in flight, 32-token "
        f"prompts, aborted after >= 8 tokens each; median of {args.repeats} rounds (ms)"
    )
    rows = [
        ("abort_all() until every call returned 'aborted'", [x["abort"] for x in rounds]),
        ("resume()", [x["resume"] for x in rounds]),
        ("abort_all() -> all requests generating again", [x["to_generating"] for x in rounds]),
        ("baseline: raw re-prefill of the same sequences", base),
    ]
    for label, xs in rows:
        print(
            f"  {label:<50}{1e3 * med(xs):>9.1f}   runs: " + ", ".join(f"{1e3 * x:.0f}" for x in xs)
        )
    over = med(x["to_generating"] for x in rounds) - med(base)
    print(f"  offbeat overhead beyond the re-prefill: {1e3 * over:.1f} ms")


# ---- job mode ------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def job_path(path: str, args: argparse.Namespace) -> dict:
    """One run of one path in this process: `--warmup-syncs` unmeasured syncs, then
    `--syncs` measured ones."""
    from job_common import OLD_PATH_OVERRIDES, GcPauses, JobLoad, LoopLag, loadavg, spin_cores

    from offbeat.core.cli import load_recipe_config

    overrides = ["runtime.progress_bar=false", *args.overrides]
    if args.max_tokens:
        overrides.append(f"rollout.max_tokens={args.max_tokens}")
    if path == "old":
        overrides += OLD_PATH_OVERRIDES
    _, cfg = load_recipe_config("separate_async", overrides)
    sampling = {"ignore_eos": True} if args.max_tokens else {}
    out: dict = {"path": path, "rows": [], "load": []}
    async with JobLoad(cfg, old_path=path == "old", sampling=sampling) as job:
        spinner = spin_cores(list(cfg.runtime.trainer_cpus)) if not args.idle_trainer else None
        lag, gcp = LoopLag(), GcPauses()
        lag.start()
        gcp.start()
        try:
            job.start_rollout()
            for i in range(args.warmup_syncs + args.syncs):
                if i == args.warmup_syncs:
                    out["load"].append(loadavg())
                await asyncio.sleep(args.interval)
                job.check()
                inflight = job.inflight
                lag.take()
                gcp.take()
                sync_s, result = await job.sync()
                gc_s = gcp.take()
                status = (await job.server_status())[0]
                srv = status.get("last_abort") or {}
                if i >= args.warmup_syncs:
                    out["rows"].append(
                        {
                            "abort": result.phase_s["abort"],
                            "sync": sync_s,
                            "phases": result.phase_s,
                            "driver_inflight": inflight,
                            "server_inflight": srv.get("inflight", -1),
                            "server_waiting": srv.get("waiting", 0),
                            # the old path paused the engine inside abort_all (pause_s);
                            # the new one aborts what the engine holds (abort_s)
                            "pause": srv.get("abort_s", srv.get("pause_s", float("nan"))),
                            "drain": srv.get("drain_s", float("nan")),
                            "lag": lag.take(),
                            "gc": gc_s,
                        }
                    )
            out["load"].append(loadavg())
        finally:
            lag.stop()
            gcp.stop()
            if spinner is not None:
                spinner.kill()
    return out


def job_report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    med = statistics.median
    print()
    print(
        f"Sync abort under the default job's load: {os.cpu_count()} CPUs shared with other "
        f"work; per path {args.runs} runs (alternating paths, each on a fresh replica) x "
        f"{args.syncs} syncs, one every {args.interval}s after {args.warmup_syncs} unmeasured; "
        f"trainer's cores {'idle' if args.idle_trainer else 'busy (matmul spinner)'}; "
        f"max_tokens {args.max_tokens or 'as configured'}"
        f"{' (ignore_eos)' if args.max_tokens else ''}. ms; median over runs of each run's "
        "p50 / p99."
    )
    print(
        "\n| path | abort p50 | abort p99 | sync p50 | sync p99 | in flight (driver / "
        "replica: in engine + waiting) | replica abort / drain p50 | driver loop lag / GC p99 | load avg (1/5/15 min) per run |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for path, runs in results.items():

        def over_runs(key: str, q: float, runs=runs) -> float:
            return 1e3 * med(pct([r[key] for r in run["rows"]], q) for run in runs)

        rows = [r for run in runs for r in run["rows"]]
        loads = ", ".join(" -> ".join(run["load"]) for run in runs)
        print(
            f"| {path} | {over_runs('abort', 0.5):.0f} | {over_runs('abort', 0.99):.0f} "
            f"| {over_runs('sync', 0.5):.0f} | {over_runs('sync', 0.99):.0f} "
            f"| {med(r['driver_inflight'] for r in rows):.0f} / "
            f"{med(r['server_inflight'] for r in rows):.0f} + "
            f"{med(r['server_waiting'] for r in rows):.0f} "
            f"| {over_runs('pause', 0.5):.0f} / {over_runs('drain', 0.5):.0f} "
            f"| {over_runs('lag', 0.99):.0f} / {over_runs('gc', 0.99):.0f} | {loads} |"
        )
    print("\nper run, abort p50 / p99 (ms):")
    for path, runs in results.items():
        each = ", ".join(
            f"{1e3 * pct([r['abort'] for r in run['rows']], 0.5):.0f}/"
            f"{1e3 * pct([r['abort'] for r in run['rows']], 0.99):.0f}"
            for run in runs
        )
        print(f"  {path}: {each}")


def job_main(args: argparse.Namespace) -> None:
    import json

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.child:  # one run of one path, for the parent below
        out = asyncio.run(job_path(args.paths, args))
        with open(args.child, "w") as f:
            json.dump(out, f)
        return
    from job_common import run_child

    paths = args.paths.split(",")
    results: dict[str, list[dict]] = {p: [] for p in paths}
    for r in range(args.runs):
        for path in paths:  # alternate, so that load drifts hit every path alike
            run = run_child(__file__, sys.argv[1:], path)
            results[path].append(run)
            rows = run["rows"]
            print(
                f"  {path}: run {r + 1}: abort p50/p99 "
                f"{1e3 * pct([x['abort'] for x in rows], 0.5):.0f}/"
                f"{1e3 * pct([x['abort'] for x in rows], 0.99):.0f} ms, load "
                f"{' -> '.join(run['load'])}",
                flush=True,
            )
    job_report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--job", action="store_true", help="the default job's conditions")
    ap.add_argument("--paths", default="old,new", help="job mode: old, new or both")
    ap.add_argument("--runs", type=int, default=3, help="job mode: runs per path")
    ap.add_argument("--syncs", type=int, default=10, help="job mode: syncs per run")
    ap.add_argument("--warmup-syncs", type=int, default=1, help="job mode: unmeasured first")
    ap.add_argument("--interval", type=float, default=1.0, help="job mode: s between syncs")
    ap.add_argument(
        "--max-tokens", type=int, default=48,
        help="job mode: response length (ignore_eos) so requests stay in flight; 0: as configured",
    )  # fmt: skip
    ap.add_argument("--idle-trainer", action="store_true", help="job mode: no spinner")
    ap.add_argument("--json", default="", help="job mode: also write the raw figures here")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="job mode: recipe config overrides")
    args = ap.parse_args()
    if args.job:
        job_main(args)
    else:
        asyncio.run(main(args))

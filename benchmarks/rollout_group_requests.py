"""One request per GRPO group against one request per sample: rollout tokens/s, same
engine, same prompts, same run.

The default job's setup (`offbeat run separate_async`, no overrides): its tiny model, its
engine arguments and replica environment, its task's prompts through the chat template,
its sampling params (T=1, n=8) and its concurrency (`runtime.max_concurrent_groups`
groups in flight). Only `max_tokens` varies (the job's 4, and longer). Two paths, each
with its own engine:

- engine-direct: `VLLMRolloutServer` in this process (confined, with its engine, to the
  replica's cores); per-sample = n `generate` calls per group, group = one
  `generate_group(n)` (vLLM's `SamplingParams.n`);
- job path: the replica as the job starts it (Ray actor, `vllm_replica`, on the replica's
  cores) behind `AsyncLoadBalancer` + `PartialRolloutClient` in this process, pinned to
  the trainer's cores as the job pins its driver; per-sample = n `client.generate` (what
  the agent loop sent before group requests; batched on the wire), group =
  `client.generate_group`.

Runs alternate (per-sample then group, group then per-sample, ...) after a warm-up, so a
load change on this shared machine hits both alike; each run records the 1-minute load
average. The table gives medians of tokens/s, the median of the paired ratios, the CPU
time this process and the replica's processes spent per 1k tokens (the figure least
disturbed by other load), that of this process alone (the client: in the job it shares
the trainer's core), and the load. It also splits the CPU into vLLM's engine processes
(engine core and worker, where the forward passes run) and the rest, which gives the
ceiling on what one request per group can save: the per-sample CPU per token over the
engine processes' alone. `--paths ... ray-busy` repeats the job path with a
thread computing on the trainer's core, in this process, as the job's trainer does.
`--one-call-each` adds a third mode to the Ray paths: per-sample requests with one Ray
call per sample (the agent loop's path before actor calls were batched, i.e. when group
requests were asked for), and compares the group path with it as well.

    uv run --frozen --no-sync python benchmarks/rollout_group_requests.py \
        [--repeats 7] [--max-tokens 4 16] [--paths direct ray ray-busy] [--one-call-each] \
        [-- key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

PER_SAMPLE = "per-sample"
GROUP = "group"
ONE_CALL_EACH = "per-sample, 1 call each"


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


class CpuMeter:
    """CPU seconds used by this process (minus threads in `exclude`: the busy trainer's)
    and by the process trees rooted at `pids` (a replica: its actor, engine core, worker).
    On a shared machine this is the figure least disturbed by other load."""

    def __init__(self) -> None:
        self.pids: list[int] = [os.getpid()]
        self.exclude: set[int] = set()

    def read(self) -> tuple[float, float, float]:
        """(all tracked processes, this process alone, vLLM's engine core and worker
        processes alone) in CPU seconds."""
        import psutil

        total = own = engine = 0.0
        seen: set[int] = set()
        for pid in self.pids:
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for pr in procs:
                if pr.pid in seen:
                    continue
                seen.add(pr.pid)
                try:
                    if pr.pid == os.getpid():
                        own = sum(t.user_time + t.system_time for t in pr.threads()
                                  if t.id not in self.exclude)  # fmt: skip
                        total += own
                    else:
                        c = pr.cpu_times()
                        total += c.user + c.system
                        if pr.name().startswith(("VLLM::EngineCor", "VLLM::Worker")):
                            engine += c.user + c.system
                except psutil.Error:
                    pass
        return total, own, engine


async def timed(make_calls, cpu: CpuMeter) -> dict[str, float]:
    """One run: tokens/s, CPU ms per 1k tokens (all; the client's process alone), the
    1-minute load average at its start."""
    load = float(loadavg())
    (c0, o0, e0), t0 = cpu.read(), time.perf_counter()
    outs = await make_calls()
    dt, (c1, o1, e1) = time.perf_counter() - t0, cpu.read()
    n = sum(len(o.token_ids) for group in outs for o in group)
    return {"tps": n / dt, "cpu": 1e6 * (c1 - c0) / n, "client": 1e6 * (o1 - o0) / n,
            "engine": 1e6 * (e1 - e0) / n, "load": load}  # fmt: skip


async def measure(name, modes, args, results, cpu: CpuMeter) -> None:
    """Interleaved runs of every mode (`[(label, fn)]`, the group mode last) at every
    max_tokens; appends to `results`. Run r of each mode are neighbours in time: the order
    turns round every repeat."""
    for mt in args.max_tokens:  # warm-up (first requests, caches, Ray's worker pool)
        for i, (_, fn) in enumerate(modes):
            await fn(mt, f"{name}-warm{i}-{mt}")
    for r in range(args.repeats):
        for mt in args.max_tokens:
            for i, (mode, fn) in enumerate(modes if r % 2 == 0 else modes[::-1]):
                tag = f"{name}{r}m{i}-{mt}"
                run = await timed(lambda fn=fn, mt=mt, tag=tag: fn(mt, tag), cpu)
                results.setdefault((name, mt), {}).setdefault(mode, []).append(run)
                print(
                    f"  {name:<8} max_tokens={mt:<3} {mode:<22} {run['tps']:6.0f} tok/s "
                    f"{run['cpu']:5.0f} CPU ms/1k tok ({run['client']:4.0f} client)  "
                    f"load {run['load']}"
                )


@contextmanager
def busy_trainer(threads: int):
    """A thread in this process computing like the trainer does, on the trainer's cores
    (inherited from `pin_trainer`): the job's client shares the process and the core with
    training."""
    import torch

    stop = threading.Event()
    ids: list[int] = []

    def train() -> None:
        ids.append(threading.get_native_id())
        torch.set_num_threads(threads)
        a = torch.randn(512, 512)
        while not stop.is_set():
            a = torch.tanh(a @ a)

    t = threading.Thread(target=train, name="busy-trainer", daemon=True)
    t.start()
    while not ids:
        time.sleep(0.001)
    try:
        yield ids[0]
    finally:
        stop.set()
        t.join()


def calls(submit_sample, submit_group, prompts, params, n, in_flight):
    """The two modes as functions of (max_tokens, tag): every prompt once, at most
    `in_flight` groups at a time (the job's rollout driver keeps that many running)."""

    async def run_groups(one_group):
        gate = asyncio.Semaphore(in_flight)

        async def gated(g, prompt):
            async with gate:
                return await one_group(g, prompt)

        return await asyncio.gather(*(gated(g, pr) for g, pr in enumerate(prompts)))

    async def per_sample(mt, tag):
        p = {**params, "max_tokens": mt}

        async def one_group(g, prompt):
            return await asyncio.gather(
                *(submit_sample(f"{tag}-{g}-{i}", prompt, p) for i in range(n))
            )

        return await run_groups(one_group)

    async def group(mt, tag):
        p = {**params, "max_tokens": mt}
        return await run_groups(lambda g, prompt: submit_group(f"{tag}-{g}", prompt, p, n))

    return per_sample, group


async def main(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.core.cli import load_recipe_config
    from offbeat.core.cpus import machine_cpus, pin_process
    from offbeat.core.models.resolve import resolve_model
    from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
    from offbeat.core.rollout.replica_spec import ReplicaSpec
    from offbeat.core.runtime.host import init_ray, pin_trainer
    from offbeat.core.tasks import make_rows
    from offbeat.core.trainer.agent_loop import encode_prompt
    from offbeat.core.trainer.rollout_side import base_sampling
    from offbeat.rollout_vllm.actor import RemoteRolloutServer
    from offbeat.rollout_vllm.replica import engine_kwargs_of, replica_cpus, vllm_replica
    from offbeat.rollout_vllm.server import VLLMRolloutServer, VLLMServerConfig

    _, cfg = load_recipe_config("separate_async", args.overrides)
    cache = Path(tempfile.gettempdir()) / "offbeat-bench-models"
    model = resolve_model(cfg.model.path, cache)
    tok = AutoTokenizer.from_pretrained(str(model))
    t = cfg.task
    in_flight = cfg.runtime.max_concurrent_groups
    rows = make_rows(t.name, args.groups, seed=t.seed, min_len=t.min_len, max_len=t.max_len)
    prompts = [encode_prompt(tok, list(r["prompt"])) for r in rows]
    params = base_sampling(cfg)
    n = cfg.rollout.n
    print(
        f"model {cfg.model.path} ({model}), {len(prompts)} groups x n={n} per run, "
        f"{in_flight} in flight, prompts "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, params {params}, "
        f"engine {engine_kwargs_of(cfg)}, replica cores and env {replica_cpus(cfg, 0)}, "
        f"trainer cores {list(cfg.runtime.trainer_cpus)}"
    )
    print(f"load average at start: {Path('/proc/loadavg').read_text().strip()}")
    results: dict = {}
    cpu = CpuMeter()

    if "direct" in args.paths:
        # The replica's cores and environment, for this process and the engine it starts.
        cores, env = replica_cpus(cfg, 0)
        saved = dict(os.environ)
        os.environ.update(env)
        if cores:
            pin_process(cores)
        server = VLLMRolloutServer(
            VLLMServerConfig(model=str(model), engine_kwargs=engine_kwargs_of(cfg))
        )
        os.environ.clear()
        os.environ.update(saved)
        try:
            per_sample, group = calls(server.generate, server.generate_group, prompts,
                                      params, n, in_flight)  # fmt: skip
            await measure("direct", [(PER_SAMPLE, per_sample), (GROUP, group)], args,
                          results, cpu)  # fmt: skip
        finally:
            server.shutdown()
            pin_process(machine_cpus())  # Ray, started next, keeps every core

    if {"ray", "ray-busy"} & set(args.paths):
        import ray

        init_ray(cfg.runtime)
        pin_trainer(cfg.runtime)  # the client runs where the job runs it: the trainer's cores
        proxy = vllm_replica(ReplicaSpec(cfg, str(model), 0))
        await proxy.refresh()
        cpu.pids.append(await proxy.handle.__ray_call__.remote(lambda self: os.getpid()))
        client = PartialRolloutClient(
            AsyncLoadBalancer({"rollout-0": proxy}), PartialRolloutConfig(max_tokens=64)
        )
        per_sample, group = calls(client.generate, client.generate_group, prompts, params, n,
                                  in_flight)  # fmt: skip
        modes = [(PER_SAMPLE, per_sample), (GROUP, group)]
        if args.one_call_each:
            # The per-sample path as it was before actor calls were batched (one Ray call
            # per sample): the agent loop's path when group requests were asked for.
            unbatched = RemoteRolloutServer(proxy.handle, proxy.weight_version, batched=False)
            client1 = PartialRolloutClient(
                AsyncLoadBalancer({"rollout-0": unbatched}), PartialRolloutConfig(max_tokens=64)
            )
            one_each, _ = calls(client1.generate, client1.generate_group, prompts, params, n,
                                in_flight)  # fmt: skip
            modes.insert(0, (ONE_CALL_EACH, one_each))
        try:
            if "ray" in args.paths:
                await measure("ray", modes, args, results, cpu)
            if "ray-busy" in args.paths:
                with busy_trainer(cfg.runtime.trainer_threads) as busy_thread:
                    cpu.exclude.add(busy_thread)
                    await measure("ray-busy", modes, args, results, cpu)
        finally:
            ray.shutdown()

    med = statistics.median
    print(
        f"\nmedian of {args.repeats} interleaved runs; {len(prompts)} groups x n={n} per run, "
        f"{in_flight} in flight; {os.cpu_count()} CPUs shared with other work. CPU: this "
        "process (the client) + the replica's processes, per 1k generated tokens"
    )
    print(
        f"{'path':<26}{'max_tok':>8}{'per-sample':>11}{'group':>8}{'ratio':>7}"
        f"{'CPU ms/1k: per-sample':>23}{'group':>7}{'ratio':>7}"
        f"{'client: per-sample':>20}{'group':>7}{'load min-max':>14}"
    )
    labels = {"direct": "engine-direct", "ray": "Ray actor + client (job)",
              "ray-busy": "  same, trainer busy"}  # fmt: skip
    for (name, mt), modes in results.items():
        b = modes[GROUP]
        for base in (PER_SAMPLE, ONE_CALL_EACH):
            if base not in modes:
                continue
            a = modes[base]
            # Run r of each mode are neighbours in time: pair them.
            ratios = [g["tps"] / s["tps"] for s, g in zip(a, b, strict=True)]
            cpu_ratios = [s["cpu"] / g["cpu"] for s, g in zip(a, b, strict=True)]
            loads = [x["load"] for x in a + b]
            label = labels[name] if base == PER_SAMPLE else f"  vs {ONE_CALL_EACH}"
            print(
                f"{label:<26}{mt:>8}{med(x['tps'] for x in a):>11.0f}"
                f"{med(x['tps'] for x in b):>8.0f}{med(ratios):>6.2f}x"
                f"{med(x['cpu'] for x in a):>23.0f}{med(x['cpu'] for x in b):>7.0f}"
                f"{med(cpu_ratios):>6.2f}x{med(x['client'] for x in a):>20.0f}"
                f"{med(x['client'] for x in b):>7.0f}{min(loads):>7.1f}-{max(loads):<6.1f}"
            )
            print(f"{'':<26}paired tokens/s ratios: " + ", ".join(f"{x:.2f}" for x in ratios))
            ea, eb = med(x["engine"] for x in a), med(x["engine"] for x in b)
            print(
                f"{'':<26}CPU ms/1k in vLLM's engine core + worker: {ea:.0f} per-sample, "
                f"{eb:.0f} group; outside them (client, actor, Ray): "
                f"{med(x['cpu'] - x['engine'] for x in a):.0f} and "
                f"{med(x['cpu'] - x['engine'] for x in b):.0f}; ceiling if a group cost "
                f"nothing outside the engine: {med(x['cpu'] for x in a) / eb:.2f}x CPU/token"
            )
    print(f"load average at end: {Path('/proc/loadavg').read_text().strip()}")
    print("target: group tokens/s >= 1.5x per-sample for n=8 with short responses")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--groups", type=int, default=192, help="groups (prompts) per run")
    ap.add_argument(
        "--paths", nargs="+", default=["direct", "ray"],
        choices=["direct", "ray", "ray-busy"],
    )  # fmt: skip
    ap.add_argument(
        "--one-call-each", action="store_true",
        help="Ray paths: also run per-sample requests with one Ray call per sample (the "
        "path before actor calls were batched) and compare the group path with it",
    )  # fmt: skip
    ap.add_argument("overrides", nargs="*", help="job config overrides (key=value)")
    asyncio.run(main(ap.parse_args()))

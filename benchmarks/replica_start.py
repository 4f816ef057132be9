"""How long a CPU vLLM replica takes to come up as the job starts it: a Ray actor started
by `vllm_replica` on the default job's prepared model and config, timed from the start
call to the replica answering (`refresh()`, what the job's `replicas_ready` waits for).

offbeat (the engine core forked from a forkserver that imported vLLM while the actor did:
`offbeat/rollout_vllm/_prestart.py`) against the same replica with it turned off
(`OFFBEAT_VLLM_PRESTART=0`: vLLM's own start in a Ray actor, its engine core spawned as a
fresh interpreter), alternating, on one Ray, in the same run. Prints each start with the
load average, then the medians.

    python benchmarks/replica_start.py [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    import ray

    from offbeat.core.cli import load_recipe_config
    from offbeat.core.runtime.host import init_ray
    from offbeat.core.trainer.elastic import start_replicas
    from offbeat.core.trainer.prepare import prepare
    from offbeat.rollout_vllm.replica import PRESTART_ENV

    _, cfg = load_recipe_config("separate_async", ["runtime.progress_bar=false"])
    init_ray(cfg.runtime)
    p = prepare(cfg)
    times: dict[str, list[float]] = {"offbeat": [], "spawn (vLLM in a Ray actor)": []}
    loads: dict[str, list[float]] = {k: [] for k in times}
    for i in range(args.runs):
        kinds = list(times) if i % 2 == 0 else list(reversed(times))
        for kind in kinds:
            env = {**p.cfg.runtime.rollout_env, PRESTART_ENV: "1" if kind == "offbeat" else "0"}
            job = dataclasses.replace(
                p.cfg, runtime=dataclasses.replace(p.cfg.runtime, rollout_env=env)
            )
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            server = start_replicas(dataclasses.replace(p, cfg=job))["rollout-0"]
            asyncio.run(server.refresh())
            ready = time.perf_counter() - t0
            ray.get(server.handle.shutdown.remote())
            ray.kill(server.handle)
            time.sleep(2)  # its processes gone before the next start
            times[kind].append(ready)
            loads[kind].append(load)
            print(f"run {i} {kind:28s} ready {ready:5.1f} s  load {load:.2f}", flush=True)
    print(f"\n{'':28s} median ready   loads at start")
    med = {k: statistics.median(v) for k, v in times.items()}
    for kind in times:
        shown = " ".join(f"{x:.2f}" for x in loads[kind])
        print(f"{kind:28s} {med[kind]:8.1f} s   {shown}")
    base = "spawn (vLLM in a Ray actor)"
    print(f"\noffbeat / spawn: {med['offbeat'] / med[base]:.2f}x")


if __name__ == "__main__":
    main()

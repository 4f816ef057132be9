"""Figure 2: CPU `broadcast` over gloo, one sender process -> 2 receiver processes, each with
a pre-allocated model. Prints effective GB/s (model bytes delivered to every receiver per
second) beside one raw gloo broadcast of the same bytes among the same three processes,
measured in the same run.

    PYTHONPATH=packages/ckpt_engine/src python benchmarks/ckpt_broadcast.py
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import time

import torch
import torch.distributed as dist
from ckpt_common import GiB, MiB, ReceiverProcess, alloc_model, lock_note, model_digest, shapes_for

from offbeat.ckpt_engine import CheckpointEngineManager


def raw_gloo_gbps(receivers: list[ReceiverProcess], nbytes: int) -> float:
    """Rank 0 broadcasts one flat buffer of `nbytes` to the receivers; best of 2 after a warm-up."""
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=120),
    )
    for rank, r in enumerate(receivers, start=1):
        r.cmds.put(("gloo_bcast", "127.0.0.1", store.port, rank, len(receivers) + 1, nbytes))
    pg = dist.ProcessGroupGloo(
        dist.PrefixStore("raw/", store), 0, len(receivers) + 1, datetime.timedelta(seconds=120)
    )
    buf = torch.ones(nbytes, dtype=torch.uint8)
    best = float("inf")
    for i in range(3):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        t0 = time.perf_counter()
        pg.broadcast([buf], opts).wait()
        if i:
            best = min(best, time.perf_counter() - t0)
    for r in receivers:
        out = r.results.get(timeout=300)
        assert out[0] == "ok", out
    return nbytes / best / 1e9


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--buckets-mib", default="64,256")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)

    shapes = shapes_for(int(args.gib * GiB), args.tensors, rows=1024)
    model = alloc_model(shapes, torch.bfloat16, "cpu", seed=0)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    ref = model_digest(model)
    ctx = mp.get_context("spawn")
    receivers = [ReceiverProcess(ctx, shapes, torch.bfloat16, "cpu") for _ in range(args.receivers)]
    print(
        f"# ckpt_broadcast: gloo, 1 sender -> {len(receivers)} receivers, {len(model)} bf16 tensors, {nbytes / GiB:.3f} GiB; {lock_note()}"
    )
    ceiling = raw_gloo_gbps(receivers, nbytes)
    print(
        f"raw gloo broadcast of one {nbytes / GiB:.3f} GiB buffer to the same receivers: {ceiling:.2f} GB/s"
    )
    print()
    print(f"| bucket | effective GB/s (median / best of {args.reps}) | vs raw broadcast |")
    print("|---|---|---|")
    version = 0
    for mib in [int(x) for x in args.buckets_mib.split(",")]:
        mgr = CheckpointEngineManager("broadcast", bucket_bytes=mib * MiB, phase_timeout_s=300)
        targets = {f"r{i}": r for i, r in enumerate(receivers)}
        times = []
        try:
            for rep in range(args.reps + 1):  # the first sync builds the process group: not timed
                version += 1
                res = await mgr.sync(model.items(), version, targets)
                assert res.ok, res.failed
                if rep:
                    times.append(res.phase_s["transfer"])
            for r in receivers:
                assert r.call("digest")[0] == ref, "received model differs"
        finally:
            mgr.close()
        med, best = sorted(times)[len(times) // 2], min(times)
        print(
            f"| {mib} MiB | {nbytes / med / 1e9:.2f} / {nbytes / best / 1e9:.2f} | {nbytes / med / 1e9 / ceiling:.0%} |"
        )
    for r in receivers:
        r.close()
    print()
    print(
        "effective GB/s = model bytes / wall time of the manager's transfer phase, every receiver"
    )
    print(
        "holding the whole model at the end (so each byte crossed the loopback once per receiver)."
    )


if __name__ == "__main__":
    asyncio.run(main())

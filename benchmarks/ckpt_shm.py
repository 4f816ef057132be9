"""Figure 1: CPU `shm`, one sender process -> one receiver process, ~1 GiB of bf16 in ~200
tensors into a pre-allocated model. Prints effective GB/s beside one-thread memcpy measured in
the same run, and peak extra RSS on each side against 2 buckets, for several bucket sizes.

    PYTHONPATH=packages/ckpt_engine/src python benchmarks/ckpt_shm.py
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time

import numpy as np
import torch
from ckpt_common import (
    GiB,
    MiB,
    ReceiverProcess,
    alloc_model,
    lock_note,
    model_digest,
    proc_status,
    reset_peak_rss,
    shapes_for,
)

from offbeat.ckpt_engine import CheckpointEngineManager


def memcpy_gbps(nbytes: int, reps: int = 5) -> float:
    """One-thread memcpy (numpy copyto of uint8 arrays, both touched first)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--buckets-mib", default="8,16,32,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--loaders", default="torch,memcpy", help="receiver load_weights: torch copy_ or memcpy"
    )
    args = ap.parse_args()

    shapes = shapes_for(int(args.gib * GiB), args.tensors, rows=1024)
    model = alloc_model(shapes, torch.bfloat16, "cpu", seed=0)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    ref = model_digest(model)
    ctx = mp.get_context("spawn")
    print(f"# ckpt_shm: {len(model)} bf16 tensors, {nbytes / GiB:.3f} GiB; {lock_note()}")
    base = memcpy_gbps(nbytes)
    print(f"one-thread memcpy of the same bytes (numpy copyto): {base:.2f} GB/s")
    print()
    print(
        f"| receiver loader | bucket | effective GB/s (median / best of {args.reps}) | vs memcpy "
        "| sender peak extra RSS | receiver peak extra RSS | 2 buckets |"
    )
    print("|---|---|---|---|---|---|---|")
    version, floors = 0, {}
    for loader in args.loaders.split(","):
        receiver = ReceiverProcess(ctx, shapes, torch.bfloat16, "cpu", loader=loader)
        (floors[loader],) = receiver.call("host_load_floor")
        for mib in [int(x) for x in args.buckets_mib.split(",")]:
            mgr = CheckpointEngineManager("shm", bucket_bytes=mib * MiB, phase_timeout_s=300)
            try:
                rss0 = proc_status("VmRSS")
                reset_peak_rss()
                times, recv_peak = [], 0
                for rep in range(args.reps + 1):  # the first sync maps the buffers: not timed
                    version += 1
                    res = await mgr.sync(model.items(), version, {"r": receiver})
                    assert res.ok, res.failed
                    if rep:
                        times.append(res.phase_s["transfer"])
                    recv_peak = max(recv_peak, receiver.last[2])
                send_peak = proc_status("VmHWM") - rss0
                assert receiver.call("digest")[0] == ref, "received model differs"
            finally:
                mgr.close()
            med, best = sorted(times)[len(times) // 2], min(times)
            g_med, g_best = nbytes / med / 1e9, nbytes / best / 1e9
            print(
                f"| {loader} | {mib} MiB | {g_med:.2f} / {g_best:.2f} | {g_med / base:.0%} | "
                f"{send_peak / MiB:.0f} MiB | {recv_peak / MiB:.0f} MiB | {2 * mib} MiB |"
            )
        receiver.close()
    print()
    print(f"one-thread memcpy again, after the syncs: {memcpy_gbps(nbytes):.2f} GB/s")
    for loader, g in floors.items():
        print(
            f"receiver's own load_weights ({loader}) from a private copy, no engine: {g:.2f} GB/s"
        )
    print()
    print("effective GB/s = model bytes / wall time of the manager's transfer phase (sender packs,")
    print(
        "receiver copies into its pre-allocated model, acks; double-buffered). Peak extra RSS: VmHWM"
    )
    print(
        "minus VmRSS before the syncs (sender: the manager's process incl. both shm buffers; receiver:"
    )
    print("per sync, incl. its mapping of both buffers).")


if __name__ == "__main__":
    asyncio.run(main())

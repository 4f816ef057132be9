"""Do kernels of two processes on one GPU run at the same time? (No MPS.)

The 2-GPU weight-sync benchmark (`train_weight_sync.py`) puts the receiver on GPU 1
beside trainer rank 1, so rank 1's sends of its shard and the receiver's broadcast
receives are kernels of two processes on one GPU. NCCL kernels hold a few SMs and wait on
the link; if the GPU time-slices between the two contexts instead of running them side by
side, the gather and the broadcast cannot overlap there, whatever the sender does.

Each process launches kernels of one Triton program that does a fixed amount of
arithmetic (a few warps on one SM: little of the GPU, like an NCCL kernel; a clock-based
spin, `torch.cuda._sleep`, would not do: it finishes on wall time even while its context
is switched out) for about `--seconds`.
Printed: the wall time of one process alone, of two processes in two contexts at once,
and of two streams in one process at once (the baseline that does overlap).

    python benchmarks/gpu_context_overlap.py [--seconds 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _work(out_ptr, iters, BLOCK: tl.constexpr):
    x = tl.arange(0, BLOCK).to(tl.float32)
    for _ in range(iters):
        x = x * 0.999999 + 0.5
    tl.store(out_ptr + tl.arange(0, BLOCK), x)


_BUF: dict = {}


def _launch(iters: int) -> None:
    out = _BUF.setdefault(torch.cuda.current_stream(), torch.empty(128, device="cuda"))
    _work[(1,)](out, iters, BLOCK=128)


def _cycles_per_ms() -> float:  # loop iterations per ms, alone
    _launch(1000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _launch(2_000_000)
    end.record()
    end.synchronize()
    return 2_000_000 / start.elapsed_time(end)


def _spin(seconds: float, cycles_per_ms: float, streams: int = 1) -> float:
    per_kernel = int(cycles_per_ms * 10)  # 10 ms kernels
    n = int(seconds * 100)
    ss = [torch.cuda.Stream() for _ in range(streams)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in ss:
        with torch.cuda.stream(s):
            for _ in range(n):
                _launch(per_kernel)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _worker(barrier, out, seconds, cycles_per_ms) -> None:
    torch.cuda.init()
    _spin(0.1, cycles_per_ms)  # context up, warm
    barrier.wait()
    out.put(_spin(seconds, cycles_per_ms))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    cpm = _cycles_per_ms()
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; "
        f"{cpm / 1e3:.0f}k loop iterations/ms; each spinner: --seconds {args.seconds} of "
        "nominally 10 ms kernels (the calibration is rough: compare the columns, not "
        "the seconds)"
    )
    ctx = mp.get_context("spawn")
    for rep in range(args.reps):
        alone = _spin(args.seconds, cpm)
        two_streams = _spin(args.seconds, cpm, streams=2)
        barrier, out = ctx.Barrier(2), ctx.Queue()
        procs = [
            ctx.Process(target=_worker, args=(barrier, out, args.seconds, cpm)) for _ in range(2)
        ]
        for q in procs:
            q.start()
        walls = [out.get(), out.get()]
        for q in procs:
            q.join()
        print(
            f"rep {rep}: one process alone {alone:.2f} s | two streams, one process "
            f"{two_streams:.2f} s | two processes at once {max(walls):.2f} s "
            f"({', '.join(f'{w:.2f}' for w in walls)})"
        )
    print(
        "two processes at once ~= 2x alone: the contexts time-slice (no overlap); "
        "~= alone: they run side by side"
    )


if __name__ == "__main__":
    main()

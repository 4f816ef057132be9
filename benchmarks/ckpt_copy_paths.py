"""How fast can a receiver copy many separate tensors on one GPU? The `cuda_ipc` figure is
bounded by this: from the second sync on, the receiver's whole job is one device copy per
tensor, out of the sender's storages into its model. Compares, on the same tensors (8 GiB of
bf16 in 500 separately allocated sources and 500 destinations by default):

  one copy        a single copy of all the bytes at once (the ceiling)
  copy_ loop      one `copy_` per tensor (what a plain `load_weights` does)
  foreach         one `torch._foreach_copy_` over all of them
  graph/bucket    the same copies captured once per bucket of ~`--bucket-mib` into CUDA
                  graphs, replayed (what `copy_into` does when the same pairs come again)
  graph/all       all copies in one CUDA graph

    python3 benchmarks/ckpt_copy_paths.py
"""

from __future__ import annotations

import argparse
import time

import torch

GiB, MiB = 1 << 30, 1 << 20


def timed(fn, reps: int) -> tuple[float, float]:
    """Median seconds of `reps` calls, device synchronised around each, and the median
    host time the call took to queue its work."""
    ts, hs = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        hs.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    hs.sort()
    return ts[len(ts) // 2], hs[len(hs) // 2]


def kernel_copy(d: torch.Tensor, s: torch.Tensor) -> None:
    """A bit-exact copy through an elementwise kernel rather than cudaMemcpyAsync."""
    torch.bitwise_or(s.view(-1).view(torch.int32), 0, out=d.view(-1).view(torch.int32))


def cudart_memcpy():
    """cudaMemcpyAsync through ctypes, skipping torch's per-call dispatch."""
    import ctypes

    with open("/proc/self/maps") as f:
        path = next(
            line.split()[-1]
            for line in f
            if "libcudart.so" in line and line.split()[-1].startswith("/")
        )
    lib = ctypes.CDLL(path)
    fn = lib.cudaMemcpyAsync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def capture(pairs, branches: int = 1, copy=None) -> torch.cuda.CUDAGraph:
    """The copies of `pairs` in one CUDA graph, dealt round-robin over `branches` parallel
    chains (forked from and joined back into the capturing stream)."""
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    forks = [torch.cuda.Stream() for _ in range(branches - 1)]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g.capture_begin(capture_error_mode="thread_local")
        for f in forks:
            f.wait_stream(side)
        streams = [side, *forks]
        for i, (d, s) in enumerate(pairs):
            with torch.cuda.stream(streams[i % branches]):
                if copy is None:
                    d.copy_(s, non_blocking=True)
                else:
                    copy(d, s)
        for f in forks:
            side.wait_stream(f)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return g


def streamed(pairs, branches: int):
    """Eager copies dealt round-robin over `branches` streams, joined back."""
    forks = [torch.cuda.Stream() for _ in range(branches - 1)]

    def run() -> None:
        main = torch.cuda.current_stream()
        for f in forks:
            f.wait_stream(main)
        streams = [main, *forks]
        for i, (d, s) in enumerate(pairs):
            with torch.cuda.stream(streams[i % branches]):
                d.copy_(s, non_blocking=True)
        for f in forks:
            main.wait_stream(f)

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--tensors", type=int, default=500)
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ckpt_copy_paths needs a CUDA device")
    # Sizes a multiple of 256 bytes, as a model's matrices are (an odd size makes every
    # copy after it in a flat storage unaligned, which is slower by itself).
    n = int(args.gib * GiB) // 2 // args.tensors // 128 * 128
    srcs = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(args.tensors)]
    dsts = [torch.empty_like(s) for s in srcs]
    flat_src = torch.empty(n * args.tensors, dtype=torch.bfloat16, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    nbytes = sum(s.nbytes for s in srcs)
    pairs = list(zip(dsts, srcs, strict=True))
    per = max(1, args.bucket_mib * MiB // (n * 2))
    buckets = [pairs[i : i + per] for i in range(0, len(pairs), per)]

    def loop() -> None:
        for d, s in pairs:
            d.copy_(s, non_blocking=True)

    graphs = [capture(b) for b in buckets]
    whole = capture(pairs)
    # The same destinations fed from views of one flat storage (a flat parameter buffer).
    views = torch.split(flat_src, [s.numel() for s in srcs])
    flat_pairs = list(zip(dsts, views, strict=True))

    def flat_loop() -> None:
        for d, s in flat_pairs:
            d.copy_(s, non_blocking=True)

    more = []
    for k in (2, 4, 8):
        g = [capture(b, k) for b in buckets]
        more.append((f"graph/bucket, {k} branches", lambda g=g: [x.replay() for x in g]))
    for k in (2, 4):
        more.append((f"copy_ loop on {k} streams", streamed(pairs, k)))

    def kernel_loop() -> None:
        for d, s in pairs:
            kernel_copy(d, s)

    more.append(("kernel loop", kernel_loop))
    for k in (1, 2, 4):
        g = [capture(b, k, kernel_copy) for b in buckets]
        more.append((f"kernel graph/bucket, {k} branches", lambda g=g: [x.replay() for x in g]))
    try:
        memcpy = cudart_memcpy()
        ptrs = [(d.data_ptr(), s.data_ptr(), s.nbytes) for d, s in pairs]

        def ctypes_loop() -> None:
            stream = torch.cuda.current_stream().cuda_stream
            for d, s, nb in ptrs:
                assert memcpy(d, s, nb, 3, stream) == 0

        more.append(("cudaMemcpyAsync via ctypes", ctypes_loop))
    except (StopIteration, OSError, AttributeError) as e:
        print(f"(no ctypes cudaMemcpyAsync: {e})")
    rows = [
        ("one copy (ceiling)", lambda: flat_dst.copy_(flat_src)),
        ("copy_ loop", loop),
        ("foreach", lambda: torch._foreach_copy_(dsts, srcs, non_blocking=True)),
        (f"graph/bucket ({len(graphs)} graphs)", lambda: [g.replay() for g in graphs]),
        ("graph/all", whole.replay),
        *more,
        ("copy_ loop, sources views of one storage", flat_loop),
    ]
    print(
        f"# ckpt_copy_paths: {torch.cuda.get_device_name()}, {args.tensors} bf16 tensors, "
        f"{nbytes / GiB:.2f} GiB, median of {args.reps}"
    )
    print("| path | ms | host ms to queue | GB/s | vs one copy |")
    print("|---|---|---|---|---|")
    ceiling = None
    for name, fn in rows:
        if name != rows[0][0]:  # every path delivers every tensor
            for d in dsts:
                d.zero_()
            fn()
            expect = flat_pairs if "views" in name else pairs
            assert all(torch.equal(d, s) for d, s in expect), name
        fn()  # warm up
        s, h = timed(fn, args.reps)
        gbps = nbytes / s / 1e9
        ceiling = ceiling or gbps
        print(f"| {name} | {s * 1e3:.2f} | {h * 1e3:.2f} | {gbps:.0f} | {gbps / ceiling:.0%} |")


if __name__ == "__main__":
    main()

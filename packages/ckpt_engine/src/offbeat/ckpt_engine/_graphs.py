"""Device copies replayed as CUDA graphs: a receiver that gets the same (destination,
source) pairs again, as it does every step once the sender's storages are read in place,
launches them as one graph instead of one copy each.

Why: on an H200, 500 copies of 16 MiB with one `copy_` (cudaMemcpyAsync) each reach 59% of
one copy of all the bytes; the same copies as elementwise kernels in a CUDA graph of two
parallel branches reach 92% (`benchmarks/ckpt_copy_paths.py`). A device-to-device memcpy
costs the device several microseconds per call beyond its bytes, and as graph nodes memcpys
do no better; kernels do, once the host no longer launches them one by one.

Knows nothing about buckets or names: it copies pairs of same-shaped tensors bitwise.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

# Copies above this size are one kernel each, dealt over the branches; smaller ones go
# through one fused multi-tensor copy inside the graph.
KERNEL_MIN_BYTES = 1 << 20
# Parallel chains in a graph: two hide each kernel's ramp-up and tail behind its neighbour's
# (one branch: 79%, two: 92%, four: 94% in the benchmark above).
BRANCHES = 2


def _word(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of `t`'s bytes, as wide as its size and address allow."""
    b = t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1)
    for dtype, n in ((torch.int32, 4), (torch.int16, 2)):
        if b.numel() % n == 0 and b.data_ptr() % n == 0:
            return b.view(dtype)
    return b


def _kernel_copy(d: torch.Tensor, s: torch.Tensor) -> None:
    """A bitwise copy through an elementwise kernel (not cudaMemcpyAsync)."""
    dw, sw = _word(d), _word(s)
    if dw.dtype != sw.dtype:  # differently aligned: bytes
        dw, sw = d.view(-1).view(torch.uint8), s.view(-1).view(torch.uint8)
    torch.bitwise_or(sw, 0, out=dw)


class GraphedCopies:
    """`dsts[i].copy_(srcs[i])` for pairs seen before, as one CUDA graph replayed on the
    current stream.

    A call whose pairs (addresses and sizes, every tensor contiguous on one CUDA device)
    match an earlier call's is captured the second time and replayed from then on; a first
    sight, or anything else, returns False and the caller copies as usual. Replaying copies
    the bytes now at those addresses, exactly what the eager copies would do. Keeps at most
    `max_graphs` graphs, least recently used first out. If capture fails once (a device or
    build without graphs), it stays off.
    """

    def __init__(self, branches: int = BRANCHES, max_graphs: int = 4096) -> None:
        self.branches = branches
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, torch.cuda.CUDAGraph | None] = OrderedDict()
        self._streams: dict[int, list[torch.cuda.Stream]] = {}
        self._lock = threading.Lock()
        # One capture at a time: captures share this object's side streams.
        self._capture_lock = threading.Lock()
        self.disabled: str | None = None

    def _key(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> tuple | None:
        d0 = dsts[0]
        if d0.device.type != "cuda":
            return None
        device = d0.device
        key: list = [device.index]
        for d, s in zip(dsts, srcs, strict=True):
            if (
                d.device != device
                or s.device != device
                or not d.is_contiguous()
                or not s.is_contiguous()
            ):
                return None
            key.append((d.data_ptr(), s.data_ptr(), d.nbytes))
        return tuple(key)

    def __call__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> bool:
        if self.disabled is not None or not dsts:
            return False
        key = self._key(dsts, srcs)
        if key is None:
            return False
        with self._lock:
            seen = key in self._graphs
            graph = self._graphs.get(key)
            if seen:
                self._graphs.move_to_end(key)
        if graph is None:
            if not seen:  # first sight: remember it, copy eagerly
                with self._lock:
                    self._graphs[key] = None
                    while len(self._graphs) > self.max_graphs:
                        self._graphs.popitem(last=False)
                return False
            try:
                with self._capture_lock:
                    graph = self._capture(dsts, srcs)
            except Exception as e:  # no graphs here: copy eagerly from now on
                self.disabled = f"{type(e).__name__}: {e}"
                return False
            with self._lock:
                self._graphs[key] = graph
        graph.replay()
        return True

    def _capture(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
        device = dsts[0].device
        with torch.cuda.device(device):
            streams = self._streams.get(device.index)
            if streams is None:
                streams = self._streams[device.index] = [
                    torch.cuda.Stream() for _ in range(self.branches)
                ]
            main, forks = streams[0], streams[1:]
            graph = torch.cuda.CUDAGraph()
            main.wait_stream(torch.cuda.current_stream())
            big = [(d, s) for d, s in zip(dsts, srcs, strict=True) if d.nbytes > KERNEL_MIN_BYTES]
            small = [
                (d, s) for d, s in zip(dsts, srcs, strict=True) if 0 < d.nbytes <= KERNEL_MIN_BYTES
            ]
            with torch.cuda.stream(main):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    for f in forks:
                        f.wait_stream(main)
                    chains = [main, *forks]
                    for i, (d, s) in enumerate(big):
                        with torch.cuda.stream(chains[i % len(chains)]):
                            _kernel_copy(d, s)
                    if small:
                        torch._foreach_copy_([d for d, _ in small], [s for _, s in small])
                    for f in forks:
                        main.wait_stream(f)
                finally:
                    graph.capture_end()
        return graph

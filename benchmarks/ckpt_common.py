"""Helpers shared by the ckpt_* benchmarks: a receiver process holding a pre-allocated
model, memory readings, model shapes. Not a figure by itself."""

from __future__ import annotations

import asyncio
import os
import queue
import time

import torch

GiB = 1 << 30
MiB = 1 << 20


def shapes_for(total_bytes: int, n: int, rows: int, itemsize: int = 2) -> list[tuple[int, int]]:
    """`n` 2-D shapes, alternately a bit wider and narrower (odd widths), ~`total_bytes`."""
    cols = total_bytes // (n * rows * itemsize)
    return [(rows, cols + (7 if i % 2 else -5)) for i in range(n)]


def proc_status(key: str) -> int:
    """A /proc/self/status field in bytes (Linux); -1 elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def alloc_model(
    shapes, dtype, device, seed: int | None = None, flat: bool = False
) -> dict[str, torch.Tensor]:
    """A model of the given shapes, every page touched. `flat`: views of one storage."""
    g = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    if flat:
        sizes = [r * c for r, c in shapes]
        storage = torch.empty(sum(sizes), dtype=dtype, device=device)
        parts = torch.split(storage, sizes)
        model = {
            f"layers.{i}.weight": p.view(s)
            for i, (p, s) in enumerate(zip(parts, shapes, strict=True))
        }
    else:
        model = {
            f"layers.{i}.weight": torch.empty(s, dtype=dtype, device=device)
            for i, s in enumerate(shapes)
        }
    for t in model.values():
        if g is None:
            t.zero_()
        else:
            t.copy_(torch.randn(t.shape, generator=g, device=device, dtype=torch.float32).to(dtype))
    return model


def model_digest(model: dict[str, torch.Tensor]) -> int:
    from offbeat.ckpt_engine.bucket import checksum, combine

    return combine(*(checksum(t.reshape(-1).view(torch.uint8)) for t in model.values()))


TIMELINE: list[tuple[str, float]] = []


def _timeline_receive(spec, load_weights, held, got: float, t0: float) -> int:
    """`receive`, noting when it connects, each bucket's load_weights and the end, in
    TIMELINE (perf_counter is one monotonic clock for every process of the machine)."""
    from offbeat.ckpt_engine import _shared_buffer, receive

    TIMELINE[:] = [("receiver: command received", got), ("receiver: receive() called", t0)]
    real_connect = _shared_buffer.connect

    def connect(*a, **kw):
        conn = real_connect(*a, **kw)
        TIMELINE.append(("receiver: connected", time.perf_counter()))
        return conn

    def load(pairs):
        TIMELINE.append(("receiver: load_weights in", time.perf_counter()))
        load_weights(pairs)
        TIMELINE.append(("receiver: load_weights out", time.perf_counter()))

    _shared_buffer.connect = connect
    try:
        held = receive(spec, load, held)
    finally:
        _shared_buffer.connect = real_connect
    TIMELINE.append(("receiver: receive() returned", time.perf_counter()))
    return held


class Channel:
    """One end of a duplex pipe with a queue's put/get: a command reaches the other process
    in tens of microseconds (a multiprocessing.Queue adds a feeder thread and more)."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def put(self, obj) -> None:
        self.conn.send(obj)

    def get(self, timeout: float | None = None):
        if timeout is not None and not self.conn.poll(timeout):
            raise queue.Empty
        return self.conn.recv()


def receiver_main(conn, shapes, dtype, device, loader: str = "torch") -> None:
    """A receiving process: a pre-allocated model and a loop over commands."""
    from offbeat.ckpt_engine import copy_into, receive

    cmds = results = Channel(conn)

    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    else:
        # One core per process: sender and receiver run side by side, and torch's pool
        # of threads fighting over contended cores is slower than one thread.
        torch.set_num_threads(1)
    model = alloc_model(shapes, dtype, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    held = 0
    state = {"loader": loader}
    fused = copy_into(model)

    def load_weights(pairs):
        loader = state["loader"]
        if loader == "foreach":  # the package's copy_into: fused multi-tensor copies
            fused(pairs)
            return
        if loader == "memcpy":  # a host loader that copies with one memcpy per tensor
            import numpy as np

            for name, t in pairs:
                dst = model[name].view(-1).view(torch.uint8).numpy()
                np.copyto(dst, t.reshape(-1).view(torch.uint8).numpy())
            return
        for name, t in pairs:
            model[name].copy_(t)

    def arm() -> tuple[int, int]:
        """Memory before the next command; peaks reset (done after answering one, so it
        is not inside the next sync's timed window)."""
        reset_peak_rss()
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            return proc_status("VmRSS"), torch.cuda.memory_allocated()
        return proc_status("VmRSS"), 0

    results.put(("ready", proc_status("VmRSS")))
    base, base_gpu = arm()
    while True:
        cmd = cmds.get()
        got = time.perf_counter()
        if cmd is None:
            return
        try:
            if cmd[0] == "sync":
                t0 = time.perf_counter()
                if len(cmd) > 2 and cmd[2] == "timeline":
                    held = _timeline_receive(cmd[1], load_weights, held, got, t0)
                elif len(cmd) > 2 and cmd[2] == "profile":
                    import cProfile
                    import io
                    import pstats

                    prof = cProfile.Profile()
                    held = prof.runcall(receive, cmd[1], load_weights, held)
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
                    print("## receiver profile\n" + out.getvalue()[-6000:], flush=True)
                else:
                    held = receive(cmd[1], load_weights, held)
                dt = time.perf_counter() - t0
                extra_gpu = (
                    torch.cuda.max_memory_allocated() - base_gpu if device.startswith("cuda") else 0
                )
                results.put(
                    ("ok", held, dt, proc_status("VmHWM") - base, extra_gpu, list(TIMELINE))
                )
                TIMELINE.clear()
            elif cmd[0] == "loader":
                state["loader"] = cmd[1]
                results.put(("ok", cmd[1]))
            elif cmd[0] == "digest":
                results.put(("ok", model_digest(model)))
            elif cmd[0] == "ipc_copy":  # the ceiling: copy a tensor shared by CUDA IPC
                from torch.multiprocessing.reductions import rebuild_cuda_tensor

                src = rebuild_cuda_tensor(*cmd[1])
                dst = torch.empty_like(src)
                best = 0.0
                for _ in range(4):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    dst.copy_(src)
                    torch.cuda.synchronize()
                    best = max(
                        best, src.numel() * src.element_size() / (time.perf_counter() - t0) / 1e9
                    )
                del src, dst
                results.put(("ok", best))
            elif cmd[0] == "load_floor":  # load_weights alone, from views of a shared storage
                from torch.multiprocessing.reductions import rebuild_cuda_tensor

                src = rebuild_cuda_tensor(*cmd[1]).view(dtype)
                sizes = [t.numel() for t in model.values()]
                views = [
                    (n, v.view(t.shape))
                    for (n, t), v in zip(model.items(), torch.split(src, sizes), strict=True)
                ]
                best = 0.0
                for _ in range(4):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    load_weights(views)
                    torch.cuda.synchronize()
                    best = max(
                        best, src.numel() * src.element_size() / (time.perf_counter() - t0) / 1e9
                    )
                del src, views
                results.put(("ok", best))
            elif cmd[0] == "host_load_floor":  # load_weights alone, from a private copy
                src = {n: t.clone() for n, t in model.items()}
                best = 0.0
                for _ in range(3):
                    t0 = time.perf_counter()
                    load_weights(list(src.items()))
                    nb = sum(t.numel() * t.element_size() for t in src.values())
                    best = max(best, nb / (time.perf_counter() - t0) / 1e9)
                del src
                results.put(("ok", best))
            elif cmd[0] == "gloo_bcast":  # the ceiling: one raw gloo broadcast of the same bytes
                import datetime

                import torch.distributed as dist

                _, host, port, rank, world, nbytes = cmd
                store = dist.TCPStore(
                    host, port, is_master=False, timeout=datetime.timedelta(seconds=120)
                )
                pg = dist.ProcessGroupGloo(
                    dist.PrefixStore("raw/", store), rank, world, datetime.timedelta(seconds=120)
                )
                buf = torch.empty(nbytes, dtype=torch.uint8)
                for _ in range(3):
                    opts = dist.BroadcastOptions()
                    opts.rootRank = 0
                    pg.broadcast([buf], opts).wait()
                results.put(("ok", 0))
        except Exception as e:
            results.put(("error", f"{type(e).__name__}: {e}"))
        base, base_gpu = arm()


class ReceiverProcess:
    """A SyncTarget whose model lives in a spawned `receiver_main` process."""

    def __init__(self, ctx, shapes, dtype, device: str, loader: str = "torch") -> None:
        mine, theirs = ctx.Pipe()
        self.cmds = self.results = Channel(mine)
        self.proc = ctx.Process(
            target=receiver_main,
            args=(theirs, shapes, dtype, device, loader),
            daemon=True,
        )
        self.proc.start()
        ready = self.results.get(timeout=600)
        self.base_rss = ready[1]
        self._version = 0
        self.last: tuple = ()

    def call(self, *cmd, timeout: float = 600):
        self.cmds.put(cmd)
        out = self.results.get(timeout=timeout)
        if out[0] != "ok":
            raise RuntimeError(out[1])
        return out[1:]

    @property
    def weight_version(self) -> int:
        return self._version

    async def abort_all(self) -> None: ...

    async def release_kv_cache(self) -> None: ...

    async def resume_kv_cache(self) -> None: ...

    async def resume(self) -> None: ...

    profile_next = False
    timeline_next = False

    async def update_weights(self, spec) -> int:
        extra = ("profile",) if self.profile_next else ()
        extra = ("timeline",) if self.timeline_next else extra
        self.marks = [("target: update_weights called", time.perf_counter())]
        self.last = await asyncio.to_thread(self.call, "sync", spec, *extra)
        self.marks.append(("target: update_weights answered", time.perf_counter()))
        self._version = self.last[0]
        return self._version

    def close(self) -> None:
        self.cmds.put(None)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def lock_note() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"

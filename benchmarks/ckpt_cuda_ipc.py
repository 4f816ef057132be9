"""Figure 3: GPU `cuda_ipc` on one GPU, ~8 GiB of bf16 in ~500 tensors, sender process ->
receiver process (pre-allocated model). Prints effective GB/s beside the device-to-device copy
bandwidth of a tensor shared across the same two processes by CUDA IPC, measured in the same
run (bytes copied per second), for three sender layouts:

  separate  500 separately allocated tensors (the default backend): from the second sync on
            (stable storages) the receiver copies straight out of the sender's tensors through
            IPC handles opened once and kept (one device copy per byte);
  flat      the same tensors as views of one flat storage (a flat parameter buffer), likewise;
  packed    separate tensors with in-place reading off (zero_copy_min_bytes=None): every byte
            is packed into a bucket buffer by the sender, then copied out by the receiver.

and two receiver loaders: `copy_` (one copy_ call per tensor, what a plain `load_weights`
does) and `copy_into` (the package's loader: a bucket whose tensors come again at the same
addresses is replayed as one CUDA graph of copy kernels; see `benchmarks/ckpt_copy_paths.py`).
The first two syncs of each row are not timed (the first packs and records the sender's
storages, the second opens them and copy_into captures its graphs).

    PYTHONPATH=packages/ckpt_engine/src python3 benchmarks/ckpt_cuda_ipc.py
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time

import torch
from ckpt_common import GiB, MiB, ReceiverProcess, alloc_model, model_digest, shapes_for

from offbeat.ckpt_engine import CheckpointEngineManager, get_backend

_PROFILE_NEXT = [False]


def _profile_sender() -> None:
    import cProfile
    import io
    import pstats

    from offbeat.ckpt_engine import _shared_buffer

    real = _shared_buffer.SharedBufferSender.send

    def send(self, named_tensors):
        if not _PROFILE_NEXT[0]:
            return real(self, named_tensors)
        prof = cProfile.Profile()
        report = prof.runcall(real, self, named_tensors)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        print("## sender profile\n" + out.getvalue()[-5000:], flush=True)
        return report

    _shared_buffer.SharedBufferSender.send = send


SENDER_TIMELINE: list[tuple[str, float]] = []


def _timeline_sender() -> None:
    """Note when the sender starts, has its receivers, publishes each bucket, has its acks
    and returns (for --timeline)."""
    from offbeat.ckpt_engine import _shared_buffer, manager

    cls = _shared_buffer.SharedBufferSender

    def wrap(owner, name: str, before: str | None, after: str | None) -> None:
        real = getattr(owner, name)

        def fn(*a, **kw):
            if before:
                SENDER_TIMELINE.append((before, time.perf_counter()))
            out = real(*a, **kw)
            if after:
                SENDER_TIMELINE.append((after, time.perf_counter()))
            return out

        setattr(owner, name, fn)

    wrap(cls, "send", "sender: send() called", "sender: send() returned")
    wrap(cls, "_accept", None, "sender: receivers connected")
    wrap(cls, "_publish", None, "sender: published")
    wrap(cls, "_wait_acks", None, "sender: acks/done in")
    wrap(manager.CheckpointEngineManager, "_transfer", "manager: transfer start", None)


def _print_timeline(marks: list[tuple[str, float]]) -> None:
    marks = sorted(marks, key=lambda m: m[1])
    t0 = marks[0][1]
    last = None
    for label, t in marks:
        if label == last and label.endswith(("published", "load_weights in", "load_weights out")):
            continue  # the first of a run of the same mark is enough
        print(f"  {(t - t0) * 1e3:8.3f} ms  {label}")
        last = label


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--tensors", type=int, default=500)
    ap.add_argument("--buckets-mib", default="512")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="profile the last sync of each row")
    ap.add_argument(
        "--timeline", action="store_true", help="print a timeline of the last sync of each row"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ckpt_cuda_ipc needs a CUDA device")
    torch.cuda.set_device(0)
    if args.profile:
        _profile_sender()
    if args.timeline:
        _timeline_sender()
    shapes = shapes_for(int(args.gib * GiB), args.tensors, rows=4096)
    ctx = mp.get_context("spawn")
    receiver = ReceiverProcess(ctx, shapes, torch.bfloat16, "cuda")
    packed = alloc_model(shapes, torch.bfloat16, "cuda", seed=0)
    flat = alloc_model(shapes, torch.bfloat16, "cuda", seed=1, flat=True)
    torch.cuda.synchronize()
    nbytes = sum(t.numel() * t.element_size() for t in packed.values())
    refs = {"separate": model_digest(packed), "flat": model_digest(flat)}
    refs["packed"] = refs["separate"]

    # The ceiling: the receiver copies the sender's flat storage, shared by CUDA IPC.
    from torch.multiprocessing.reductions import reduce_tensor

    storage = next(iter(flat.values()))
    whole = torch.empty(0, dtype=torch.uint8, device="cuda").set_(storage.untyped_storage())
    (ceiling,) = receiver.call("ipc_copy", tuple(reduce_tensor(whole)[1]))
    (floor,) = receiver.call("load_floor", tuple(reduce_tensor(whole)[1]))
    receiver.call("loader", "foreach")
    (floor_foreach,) = receiver.call("load_floor", tuple(reduce_tensor(whole)[1]))
    del whole
    print(
        f"# ckpt_cuda_ipc: {torch.cuda.get_device_name()}, {len(packed)} bf16 tensors, {nbytes / GiB:.2f} GiB"
    )
    print(
        f"device-to-device copy of a CUDA-IPC-shared tensor ({nbytes / GiB:.2f} GiB, best of 4): {ceiling:.0f} GB/s"
    )
    print(
        f"the receiver's own load_weights (500 copy_ calls) from the same shared storage: {floor:.0f} GB/s"
    )
    print(
        f"the receiver's own load_weights (copy_into, graphs replayed) from the same shared storage: {floor_foreach:.0f} GB/s"
    )
    print()
    print(
        f"| sender layout | loader | bucket | effective GB/s (median / best of {args.reps}) | vs D2D copy | receiver receive() ms | receiver peak extra GPU memory | 2 buckets |"
    )
    print("|---|---|---|---|---|---|---|---|")
    version = 0
    rows = [
        ("separate", packed, "copy_"),
        ("separate", packed, "copy_into"),
        ("flat", flat, "copy_"),
        ("flat", flat, "copy_into"),
        ("packed", packed, "copy_"),
        ("packed", packed, "copy_into"),
    ]
    for layout, model, loader in rows:
        receiver.call("loader", "foreach" if loader == "copy_into" else "torch")
        for mib in [int(x) for x in args.buckets_mib.split(",")]:
            backend = get_backend("cuda_ipc")(zero_copy_min_bytes=None if layout == "packed" else 0)
            mgr = CheckpointEngineManager(backend, bucket_bytes=mib * MiB, phase_timeout_s=300)
            times, peak, recv_s = [], 0, []
            try:
                for rep in range(args.reps + 2):  # two warm-up syncs (see the docstring)
                    version += 1
                    receiver.profile_next = args.profile and rep == args.reps + 1
                    _PROFILE_NEXT[0] = receiver.profile_next
                    receiver.timeline_next = args.timeline and rep == args.reps + 1
                    SENDER_TIMELINE.clear()
                    t_sync = time.perf_counter()
                    res = await mgr.sync(model.items(), version, {"r": receiver})
                    t_end = time.perf_counter()
                    assert res.ok, res.failed
                    if receiver.timeline_next:
                        print(f"## timeline: {layout} / {loader}")
                        _print_timeline(
                            [
                                ("manager: sync() called", t_sync),
                                ("manager: sync() returned", t_end),
                            ]
                            + SENDER_TIMELINE
                            + receiver.marks
                            + receiver.last[4]
                        )
                    if receiver.profile_next:
                        print("## phases", {k: round(v * 1e3, 2) for k, v in res.phase_s.items()})
                    if rep >= 2:
                        times.append(res.phase_s["transfer"])
                        recv_s.append(receiver.last[1])
                    peak = max(peak, receiver.last[3])
                assert receiver.call("digest")[0] == refs[layout], "received model differs"
            finally:
                mgr.close()
            med, best = sorted(times)[len(times) // 2], min(times)
            g_med, g_best = nbytes / med / 1e9, nbytes / best / 1e9
            print(
                f"| {layout} | {loader} | {mib} MiB | {g_med:.0f} / {g_best:.0f} | {g_med / ceiling:.0%} | {sorted(recv_s)[len(recv_s) // 2] * 1e3:.1f} | "
                f"{peak / MiB:.0f} MiB | {2 * mib} MiB |"
            )
    receiver.close()
    print()
    print(
        "effective GB/s = model bytes / wall time of the manager's transfer phase (sender process"
    )
    print(
        "to receiver process through the control channel, receiver copies into its model and acks)."
    )
    print("Receiver peak extra GPU memory = max_memory_allocated during a sync minus before (the")
    print("bucket buffers are the sender's allocations, mapped by IPC, so they do not show here).")


if __name__ == "__main__":
    asyncio.run(main())

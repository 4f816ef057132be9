"""Figure: end-to-end weight sync of a 7B-shaped Qwen2 (bf16 export, ~15.2 GB) from a 2-rank
FSDP2 trainer (float32 master shards, one per GPU) into a receiver process through the
`broadcast` checkpoint-engine backend on NCCL, the FSDP gather included; beside the raw
NCCL broadcast bandwidth between the same two processes, measured in the same run, and
verl's published 0.07 s for a 7B export.

    PYTHONPATH=packages/core/src:packages/ckpt_engine/src:packages/balancer/src \
        torchrun --standalone --nproc-per-node=2 benchmarks/train_weight_sync.py

Trainer rank r runs on GPU r; the receiver runs on GPU 1 (beside trainer rank 1: two
GPUs, three processes) and holds a pre-allocated bf16 model that `copy_into` fills. Rank 0
is the sender. Rows:
- `gather_weights` (new): rank 1 sends its bf16-cast shard of each parameter to rank 0,
  which receives it into the full tensor and streams it to the manager (holding one full
  parameter, or receiving up to a bucket's bytes ahead);
- `export_weights`: every rank all-gathers each parameter (`DTensor.full_tensor`), as a
  one-rank trainer does;
- pre-gathered: rank 0 already holds the full bf16 model (the backend alone, no gather).
Time = the transfer phase of `CheckpointEngineManager.sync` (the other phases are no-ops
here; the whole call's wall time is in the comment under each row), median of `--reps`
after one warm-up sync; the receiver's model is zeroed before each row and checked
bit-exact against the sender's after it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import os
import statistics
import time

import torch
import torch.distributed as dist
from ckpt_common import Channel, GiB, MiB, model_digest

QWEN2_7B = {
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}
VERL_7B_S = 0.07


def receiver_main(conn, shapes: dict[str, tuple[int, ...]], graphs: bool) -> None:
    from offbeat.ckpt_engine import copy_into, receive

    ch = Channel(conn)
    torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES names the GPU
    model = {n: torch.empty(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes.items()}
    load = copy_into(model, graphs=graphs)
    held = 0
    ch.put(("ready",))
    while True:
        cmd = ch.get()
        if cmd is None:
            return
        try:
            if cmd[0] == "sync":
                held = receive(cmd[1], load, held)
                torch.cuda.synchronize()
                ch.put(("ok", held))
            elif cmd[0] == "digest":
                ch.put(("ok", model_digest(model)))
            elif cmd[0] == "zero":
                for t in model.values():
                    t.zero_()
                torch.cuda.synchronize()
                ch.put(("ok", 0))
            elif cmd[0] == "raw":  # the ceiling: plain NCCL broadcasts from rank 0
                _, port, sizes, reps = cmd
                store = dist.TCPStore(
                    "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120)
                )
                pg = dist.ProcessGroupNCCL(dist.PrefixStore("raw/", store), 1, 2)
                for n in sizes:
                    buf = torch.empty(n, dtype=torch.uint8, device="cuda")
                    for _ in range(reps + 1):
                        _bcast(pg, buf)
                        torch.cuda.synchronize()
                    del buf
                ch.put(("ok", 0))
        except Exception as e:
            ch.put(("error", f"{type(e).__name__}: {e}"))


def _bcast(pg, buf):
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([buf], opts).wait()


class Receiver:
    """A SyncTarget whose model lives in a process on another GPU."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], gpu: str, graphs: bool) -> None:
        ctx = mp.get_context("spawn")
        mine, theirs = ctx.Pipe()
        self.ch = Channel(mine)
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
        try:
            self.proc = ctx.Process(
                target=receiver_main, args=(theirs, shapes, graphs), daemon=True
            )
            self.proc.start()
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES")
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        assert self.ch.get(timeout=600)[0] == "ready"
        self._version = 0

    def call(self, *cmd):
        self.ch.put(cmd)
        out = self.ch.get(timeout=600)
        if out[0] != "ok":
            raise RuntimeError(out[1])
        return out[1]

    @property
    def weight_version(self) -> int:
        return self._version

    async def abort_all(self) -> None: ...

    async def release_kv_cache(self) -> None: ...

    async def resume_kv_cache(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, spec) -> int:
        self._version = await asyncio.to_thread(self.call, "sync", spec)
        return self._version

    def close(self) -> None:
        self.ch.put(None)
        self.proc.join(30)


def raw_broadcast_gbps(receiver: Receiver, sizes: list[int], reps: int) -> dict[int, float]:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    receiver.ch.put(("raw", store.port, sizes, reps))
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("raw/", store), 0, 2)
    out = {}
    for n in sizes:
        buf = torch.ones(n, dtype=torch.uint8, device="cuda")
        times = []
        for i in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _bcast(pg, buf)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        out[n] = n / statistics.median(times) / 1e9
        del buf
    assert receiver.ch.get(timeout=300)[0] == "ok"
    return out


def build_engine():
    from transformers import AutoModelForCausalLM, Qwen2Config

    from offbeat.core.train import FSDP2Config, FSDP2TrainEngine

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_7B), dtype=torch.float32)
    config = FSDP2Config(device="cuda", param_dtype="bfloat16", export_dtype="bfloat16")
    return FSDP2TrainEngine(config, model=model)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--buckets-mib", default="2048,1024")
    ap.add_argument("--receiver-graphs", type=int, default=1, help="copy_into's CUDA graphs")
    args = ap.parse_args()
    from offbeat.ckpt_engine import CheckpointEngineManager

    engine = build_engine()  # joins the torchrun group (gloo + nccl)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "run under torchrun with --nproc-per-node=2"
    # Ranks line up on the host: an NCCL barrier would leave a kernel spinning on GPU 1
    # while rank 0 syncs, and the receiver on that GPU would share its time with it.
    host_group = dist.new_group(backend="gloo")
    shapes = {n: tuple(p.shape) for n, p in engine.model.named_parameters()}
    nbytes = sum(2 * torch.Size(s).numel() for s in shapes.values())
    receiver = None
    if rank == 0:
        receiver = Receiver(shapes, gpu="1", graphs=bool(args.receiver_graphs))
        load = os.getloadavg()
        print(
            f"# train_weight_sync: Qwen2-7B shape, {len(shapes)} tensors, {nbytes / 1e9:.2f} GB "
            f"bf16; 2 FSDP2 ranks (GPU 0, 1) -> 1 receiver (GPU 1); {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}; receiver copy_into graphs={bool(args.receiver_graphs)}; "
            f"load average {load[0]:.2f}",
            flush=True,
        )
        raw = raw_broadcast_gbps(receiver, [256 * MiB, GiB, 4 * GiB], reps=5)
        for n, gbps in raw.items():
            print(
                f"raw NCCL broadcast GPU0 -> GPU1, one {n / MiB:.0f} MiB message: {gbps:.1f} GB/s"
            )
        ceiling = raw[4 * GiB]
        print(
            f"at the 4 GiB rate the model takes {nbytes / ceiling / 1e9 * 1e3:.1f} ms; "
            f"verl's published 7B export: {VERL_7B_S * 1e3:.0f} ms "
            f"({nbytes / VERL_7B_S / 1e9:.0f} GB/s for these bytes)",
            flush=True,
        )
        pre = {n: t.clone() for n, t in engine.gather_weights(0)}
        want = model_digest(pre)
        print()
        print(
            f"| path | bucket | sync ms (median of {args.reps}) | GB/s | vs raw broadcast | exact |"
        )
        print("|---|---|---|---|---|---|")
    else:
        for _ in engine.gather_weights(0):
            pass
        pre = None
    dist.barrier(group=host_group)

    version = 0
    for mib in [int(x) for x in args.buckets_mib.split(",")]:
        rows = [
            ("gather_weights", "gather", 0),
            ("gather_weights, a bucket of prefetch", "gather", mib * MiB),
            ("export_weights", "export", 0),
            ("pre-gathered", "pre", 0),
        ]
        mgr = CheckpointEngineManager(
            "broadcast", bucket_bytes=mib * MiB, phase_timeout_s=600,
            backend_options={"device": "cuda"},
        ) if rank == 0 else None  # fmt: skip
        for label, how, prefetch in rows:
            times, walls = [], []
            if rank == 0:
                receiver.call("zero")  # so the digest below checks this row's syncs
            for rep in range(args.reps + 1):
                version += 1
                dist.barrier(group=host_group)
                torch.cuda.synchronize()
                if rank == 0:
                    stream = {
                        "gather": lambda p=prefetch: engine.gather_weights(0, p),
                        "export": engine.export_weights,
                        "pre": lambda: iter(pre.items()),
                    }[how]
                    t0 = time.perf_counter()
                    res = asyncio.run(mgr.sync(stream, version, {"r": receiver}))
                    dt = time.perf_counter() - t0
                    assert res.ok, res.failed
                    if rep:
                        times.append(res.phase_s["transfer"])
                        walls.append(dt)
                elif how != "pre":
                    it = engine.gather_weights(0) if how == "gather" else engine.export_weights()
                    for _ in it:
                        pass
            if rank == 0:
                exact = receiver.call("digest") == want
                med = statistics.median(times)
                print(
                    f"| {label} | {mib} MiB | {med * 1e3:.1f} | {nbytes / med / 1e9:.1f} | "
                    f"{nbytes / med / 1e9 / ceiling:.0%} | {exact} |",
                    flush=True,
                )
                print(
                    f"<!-- {label} {mib} MiB: transfer {[round(t * 1e3, 1) for t in times]} ms, "
                    f"sync() wall {[round(t * 1e3, 1) for t in walls]} ms -->"
                )
        if mgr is not None:
            mgr.close()
    dist.barrier(group=host_group)
    if rank == 0:
        receiver.close()
        print()
        print("GB/s = model bytes / transfer time; vs raw = that over the raw 4 GiB broadcast.")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Bucketing invariants: exact filled lengths, splits that reassemble, lazy pulling, and a
buffer never refilled while a receiver still reads it."""

from __future__ import annotations

import time

import pytest
import torch
from ckpt_engine_fakes import BUCKET, digest

from offbeat.ckpt_engine import ALIGN, CheckpointEngineManager, Reassembler, plan_buckets
from offbeat.ckpt_engine.bucket import pack


def test_buckets_exact_length_and_split_reassembly(model):
    buckets = list(plan_buckets(model.items(), BUCKET))
    reasm, out = Reassembler(), {}
    for b in buckets:
        assert 0 < b.filled <= BUCKET
        assert b.filled == max(e.offset + e.nbytes for e in b.entries)  # no padding sent
        assert all(e.offset % ALIGN == 0 for e in b.entries)
        buf = torch.full((BUCKET,), 0xAB, dtype=torch.uint8)
        view = pack(b, buf)
        assert view.numel() == b.filled
        out.update(reasm.take(b.entries, view))
    reasm.finish()
    assert {n: digest(t) for n, t in out.items()} == {n: digest(t) for n, t in model.items()}
    big = [e for b in buckets for e in b.entries if e.name == "big.weight"]
    assert len(big) >= 3 and sum(e.nbytes for e in big) == big[0].total


def test_pulls_tensors_lazily():
    pulled = []

    def stream():
        for i in range(50):
            pulled.append(i)
            yield f"w{i}", torch.full((100,), i, dtype=torch.float32)  # 400 B each

    it = plan_buckets(stream(), 1024)
    first = next(it)
    assert len(first.entries) == 2
    assert len(pulled) == 3  # the two placed plus the one that did not fit


def test_incomplete_split_tensor_is_an_error():
    b = next(plan_buckets([("x", torch.zeros(2000))], 4096))
    reasm = Reassembler()
    assert reasm.take(b.entries, pack(b, torch.empty(4096, dtype=torch.uint8))) == []
    with pytest.raises(Exception, match="incomplete tensors: x"):
        reasm.finish()


def test_bad_bucket_size():
    with pytest.raises(ValueError, match="multiple of 256"):
        list(plan_buckets([("x", torch.zeros(1))], 100))


async def test_buffer_not_refilled_while_receiver_reads(make_target):
    """load_weights gets views of the shared buffer: they must not change until it returns."""
    model = {f"w{i}": torch.full((300,), float(i)) for i in range(40)}
    target = make_target("slow")
    changed = []
    real = target.sink.load_weights

    def slow_load(pairs):
        before = [digest(t) for _, t in pairs]
        time.sleep(0.01)  # the sender races ahead if it can
        after = [digest(t) for _, t in pairs]
        changed.append(before != after)
        real(pairs)

    target.sink.load_weights = slow_load
    mgr = CheckpointEngineManager("shm", bucket_bytes=BUCKET, phase_timeout_s=20)
    res = await mgr.sync(model.items(), 1, {"slow": target})
    assert res.ok and len(changed) >= 10 and not any(changed)
    assert all(torch.equal(target.sink.weights[n], t) for n, t in model.items())


@pytest.mark.parametrize("backend", ["naive", "shm", "broadcast", "disk"])
async def test_sender_holds_at_most_two_buckets_of_a_transient_stream(backend, make_target):
    """Tensors made on the fly (like gathered shards) are released as their bucket goes
    (reference counting frees them at once; the finalizers track which are alive)."""
    import weakref

    alive: set[int] = set()
    peak = [0]

    def stream():
        for i in range(60):
            t = torch.full((250,), float(i))  # 1000 B: four to a 4 KiB bucket
            alive.add(i)
            weakref.finalize(t, alive.discard, i)
            peak[0] = max(peak[0], len(alive))
            yield f"w{i}", t
            del t

    target = make_target("r")
    mgr = CheckpointEngineManager(backend, bucket_bytes=BUCKET, phase_timeout_s=30)
    try:
        res = await mgr.sync(stream(), 1, {"r": target})
    finally:
        mgr.close()
    assert res.ok and len(target.sink.weights) == 60
    per_bucket = BUCKET // 1024
    assert peak[0] <= 2 * per_bucket + 1, peak[0]

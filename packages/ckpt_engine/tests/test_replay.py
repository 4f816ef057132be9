"""The sender's replay of buckets read wholly in place (what cuda_ipc does from the second
sync of a trainer's stable parameters), checked on the CPU with a pair that shares every
storage in place: values updated in place, a tensor replaced, a stream cut short."""

from __future__ import annotations

import threading

import torch
from ckpt_engine_fakes import digest

from offbeat.ckpt_engine._shared_buffer import BufferPair, SharedBufferSender, receive_shared
from offbeat.ckpt_engine.target import ReceiveSpec

BUCKET = 4096
_STORAGES: dict[str, torch.Tensor] = {}


class _InPlacePair(BufferPair):
    def __init__(self) -> None:
        self.buffers = [torch.zeros(BUCKET, dtype=torch.uint8) for _ in range(2)]
        self.kept: list = []

    def describe(self) -> dict:
        return {}

    def share(self, piece: torch.Tensor):
        st = piece.untyped_storage()
        key = f"{st.data_ptr()}:{st.nbytes()}"
        if key not in _STORAGES:
            _STORAGES[key] = torch.empty(0, dtype=torch.uint8).set_(st)
        return key, piece.data_ptr() - st.data_ptr()

    def descriptor(self, key) -> str:
        return key

    def keep(self, keys: list) -> None:
        self.kept.extend(keys)


def _sync(pair: _InPlacePair, named: list[tuple[str, torch.Tensor]], version: int) -> dict:
    sender = SharedBufferSender(
        "inplace", pair, version=version, num_receivers=1, bucket_bytes=BUCKET,
        checksum=False, timeout_s=20,
    )  # fmt: skip
    spec: ReceiveSpec = sender.spec(0)
    got: dict[str, torch.Tensor] = {}

    def load(pairs) -> None:
        for n, t in pairs:
            got[n] = t.clone()

    report = {}
    th = threading.Thread(target=lambda: report.setdefault("r", sender.send(iter(named))))
    th.start()
    receive_shared(spec, load, None, lambda ch: pair.buffers, open_storage=_STORAGES.__getitem__)
    th.join(20)
    assert report["r"].failed == {}
    return got


def test_replayed_buckets_deliver_each_syncs_values():
    pair = _InPlacePair()
    model = [(f"w{i}", torch.randn(100 + i)) for i in range(40)]  # ~16 KiB: several buckets
    model.append(("big", torch.randn(3 * BUCKET // 4 + 3)))  # split over buckets
    for version in (1, 2):
        for _, t in model:
            t.add_(1)  # a trainer's step, in place
        got = _sync(pair, model, version)
        assert {n: digest(t) for n, t in got.items()} == {n: digest(t) for n, t in model}
    assert pair.replays and pair.kept  # the second sync replayed buckets

    model[7] = ("w7", torch.randn(107))  # a new tensor in the middle: planned afresh from there
    got = _sync(pair, model, 3)
    assert {n: digest(t) for n, t in got.items()} == {n: digest(t) for n, t in model}

    short = model[:20]  # a stream that ends early
    got = _sync(pair, short, 4)
    assert {n: digest(t) for n, t in got.items()} == {n: digest(t) for n, t in short}

    renamed = [(f"x{i}", t) for i, (_, t) in enumerate(model)]  # same tensors, other names
    got = _sync(pair, renamed, 5)
    assert {n: digest(t) for n, t in got.items()} == {n: digest(t) for n, t in renamed}

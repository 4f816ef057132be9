"""`cuda_ipc`: GPU buckets shared with receivers on the same GPU or node by CUDA IPC
handles; receivers hand `load_weights` zero-copy views.

Two bucket buffers are allocated once and kept across syncs, and receivers keep what they
opened, so steady-state syncs open no handle (opening handles is what costs). A piece that
lies on the sender's device, in a storage (of at least `zero_copy_min_bytes`) that was
already sent from in the previous sync, is not packed at all: receivers read it in place,
which saves one device copy per byte. Trainer parameters keep their storages from step to
step, so from the second sync on they travel in place; each storage's descriptor is made
once and receivers keep what they opened by descriptor, so a steady-state sync costs no IPC
call per tensor. Storages first seen in a sync (transient tensors) are packed. Knows
nothing about which process owns which GPU beyond the device UUID: a receiver maps the
sender's device to its own index, so differing CUDA_VISIBLE_DEVICES do not matter.
"""

from __future__ import annotations

import base64
import pickle
import threading
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offbeat.ckpt_engine._shared_buffer import BufferPair, SharedBufferSender, receive_shared
from offbeat.ckpt_engine.errors import PeerError
from offbeat.ckpt_engine.registry import Backend, Sender, register_backend
from offbeat.ckpt_engine.target import LoadWeightsFn, ReceiveSpec

__all__ = ["CudaIpcBackend"]


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _describe(t: torch.Tensor) -> tuple:
    from torch.multiprocessing.reductions import reduce_tensor

    return tuple(reduce_tensor(t)[1])


class _CudaPair(BufferPair):
    def __init__(
        self, bucket_bytes: int, device: torch.device, zero_copy_min_bytes: int | None
    ) -> None:
        self.device, self.size = device, bucket_bytes
        self.zero_copy_min_bytes = zero_copy_min_bytes
        self.buffers = [
            torch.empty(bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)
        ]
        self._handles = [_describe(b) for b in self.buffers]
        self._described: dict[str, Any] | None = None
        # storage key -> [weak reference, descriptor ("" until first shared), sync first seen]
        self._shared: dict[tuple[int, int], list] = {}
        self._seen: set[tuple[int, int]] = set()
        self._sync = 0

    def describe(self) -> dict[str, Any]:
        # Plain strings: RPC layers that re-encode the spec (msgpack, JSON) pass it intact.
        # The buffers live as long as the pair: described once.
        if self._described is None:
            ipc = [base64.b64encode(pickle.dumps(h)).decode() for h in self._handles]
            self._described = {"ipc": ipc, "device_uuid": _uuid(self.device.index)}
        return dict(self._described)

    def fence(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def share(self, piece: torch.Tensor) -> tuple[Any, int] | None:
        if self.zero_copy_min_bytes is None or piece.device != self.device:
            return None
        storage = piece.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.zero_copy_min_bytes:
            return None
        base = storage.data_ptr()
        key = (base, nbytes)
        self._seen.add(key)
        known = self._shared.get(key)
        if known is None or known[0].expired():
            # First seen, or its memory was freed and reused: pack it this time. A storage
            # still alive at the next sync is a stable one (a trainer's parameter) and is
            # read in place from then on; a transient one (a gathered or converted tensor)
            # is never mapped by receivers, who would otherwise pin its memory.
            self._shared[key] = [StorageWeakRef(storage), "", self._sync]
            return None
        if known[2] == self._sync:
            return None
        if not known[1]:
            whole = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
            known[1] = base64.b64encode(pickle.dumps(_describe(whole))).decode()
        return key, piece.data_ptr() - base

    def descriptor(self, key: Any) -> str:
        return self._shared[key][1]

    def keep(self, keys: list) -> None:
        self._seen.update(keys)

    def release(self) -> None:
        # Remember (weakly) the storages this sync sent from, for the next one. A trainer's
        # step sends from the same ones: nothing to drop then (a storage freed since is
        # noticed by `share`, which checks the weak reference before reading in place).
        if not self._seen.issuperset(self._shared):
            self._shared = {k: v for k, v in self._shared.items() if k in self._seen}
        self._seen = set()
        self._sync += 1

    def close(self) -> None:
        self.buffers = []
        self._handles = []
        self._shared = {}


def _local_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if _uuid(i) == uuid:
            return i
    raise PeerError(
        f"the sender's GPU {uuid} is not visible in this process ({torch.cuda.device_count()} visible)"
    )


# Receiver side: what this process opened, kept while the sender keeps offering it: bucket
# buffers by handle, storages read in place by their descriptor string.
_OPENED: dict[tuple, torch.Tensor] = {}
_OPENED_STORAGES: dict[str, torch.Tensor] = {}
_OPENED_LOCK = threading.Lock()


def _open(args: tuple, index: int, cache: bool = True) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    # (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, size_bytes,
    #  offset_bytes, ...): the same handle and range are the same memory.
    key = (bytes(args[7]), args[8], args[9], tuple(args[1]), args[3])
    with _OPENED_LOCK:
        t = _OPENED.get(key)
    if t is None:
        args = list(args)
        args[6] = index  # storage_device, as seen from this process
        t = rebuild_cuda_tensor(*args)
        if cache:
            with _OPENED_LOCK:
                _OPENED[key] = t
    return t


def _attach(channel: dict[str, Any]) -> tuple[list[torch.Tensor], int]:
    if not torch.cuda.is_available():
        raise PeerError("cuda_ipc receiver: CUDA is not available in this process")
    index = _local_index(channel["device_uuid"])
    return [_open(a, index) for a in _decode(channel)], index


def _decode(channel: dict[str, Any]) -> list[tuple]:
    return [tuple(pickle.loads(base64.b64decode(a))) for a in channel["ipc"]]


class CudaIpcBackend(Backend):
    """Options: `device` (default: the current CUDA device) holds the sender's buffers;
    `zero_copy_min_bytes` (default 0: every piece on that device; None turns it off):
    pieces of storages at least this large are read in place by receivers instead of being
    packed into a bucket buffer (which costs a second device copy per byte)."""

    default_bucket_bytes = 512 << 20  # see the README's "Bucket size"
    reach, device_types = "host", ("cuda",)

    def __init__(
        self,
        device: str | int | torch.device | None = None,
        zero_copy_min_bytes: int | None = 0,
    ) -> None:
        self._device = device
        self._zero_copy = zero_copy_min_bytes
        self._pair: _CudaPair | None = None

    def open_sender(
        self,
        *,
        version: int,
        num_receivers: int,
        bucket_bytes: int,
        checksum: bool,
        timeout_s: float,
        members: tuple[str, ...] = (),
    ) -> Sender:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "backend 'cuda_ipc' needs a CUDA device; use 'shm' on CPU-only machines"
            )
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if self._device is None
            else torch.device(self._device)
        )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self._pair is None or self._pair.size != bucket_bytes or self._pair.device != device:
            self._pair = _CudaPair(bucket_bytes, device, self._zero_copy)
        return SharedBufferSender(
            self.name,
            self._pair,
            version=version,
            num_receivers=num_receivers,
            bucket_bytes=bucket_bytes,
            checksum=checksum,
            timeout_s=timeout_s,
        )

    def close(self) -> None:
        self._pair = None

    @classmethod
    def receive(
        cls, spec: ReceiveSpec, load_weights: LoadWeightsFn, current_version: int | None
    ) -> int:
        device: list[int] = []
        used: set[tuple] = set()
        used_storages: set[str] = set()

        def attach(channel: dict[str, Any]) -> list[torch.Tensor]:
            buffers, index = _attach(channel)
            device.append(index)
            used.update((bytes(a[7]), a[8], a[9], tuple(a[1]), a[3]) for a in _decode(channel))
            return buffers

        def open_storage(blob: str) -> torch.Tensor:
            used_storages.add(blob)
            with _OPENED_LOCK:
                t = _OPENED_STORAGES.get(blob)
            if t is None:
                t = _open(tuple(pickle.loads(base64.b64decode(blob))), device[0], cache=False)
                with _OPENED_LOCK:
                    _OPENED_STORAGES[blob] = t
            return t

        def mark() -> torch.cuda.Event:
            # load_weights queues its copies on the current stream; they are done when
            # this event is (waited on before the bucket is acked).
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device[0]))
            return event

        try:
            return receive_shared(spec, load_weights, current_version, attach, mark, open_storage)
        finally:
            with _OPENED_LOCK:  # forget what this sync no longer offered
                if not used.issuperset(_OPENED):
                    for key in [k for k in _OPENED if k not in used]:
                        del _OPENED[key]
                if not used_storages.issuperset(_OPENED_STORAGES):
                    for blob in [b for b in _OPENED_STORAGES if b not in used_storages]:
                        del _OPENED_STORAGES[blob]


register_backend("cuda_ipc", CudaIpcBackend)

"""`shm`: host shared memory between processes on one machine (the CPU path).

The sender maps two files of `bucket_bytes` in the shared-memory filesystem; receivers map
the same files and hand `load_weights` zero-copy views of them. The pair is kept across
syncs (and receivers keep their mappings) so steady-state syncs fault in no fresh pages;
it is unlinked when the backend closes or the process exits. Knows nothing about the
devices the weights end up on: `load_weights` copies wherever the model lives.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import tempfile
import threading
from collections import OrderedDict
from typing import Any

import torch

from offbeat.ckpt_engine._shared_buffer import BufferPair, SharedBufferSender, receive_shared
from offbeat.ckpt_engine.errors import PeerError
from offbeat.ckpt_engine.registry import Backend, Sender, register_backend
from offbeat.ckpt_engine.target import LoadWeightsFn, ReceiveSpec

__all__ = ["ShmBackend"]


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _ShmPair(BufferPair):
    def __init__(self, bucket_bytes: int) -> None:
        tag = secrets.token_hex(8)
        self.size = bucket_bytes
        self._paths = [
            os.path.join(_shm_dir(), f"offbeat-ckpt-{os.getpid()}-{tag}-{i}") for i in range(2)
        ]
        atexit.register(self.close)
        self.buffers = [
            torch.from_file(p, shared=True, size=bucket_bytes, dtype=torch.uint8)
            for p in self._paths
        ]
        for b in self.buffers:
            b.zero_()  # fault the pages in once, not during the first sync

    def describe(self) -> dict[str, Any]:
        return {"paths": list(self._paths), "size": self.size}

    def close(self) -> None:
        for p in self._paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        self.buffers = []


# Receiver side: mappings kept across syncs, keyed by the sender's file names.
_MAPPED: OrderedDict[tuple[str, ...], list[torch.Tensor]] = OrderedDict()
_MAPPED_LOCK = threading.Lock()
_MAX_MAPPED = 4


def _attach(channel: dict[str, Any]) -> list[torch.Tensor]:
    key = tuple(channel["paths"])
    with _MAPPED_LOCK:
        for old in [k for k in _MAPPED if k != key and not os.path.exists(k[0])]:
            del _MAPPED[old]  # that sender is gone: let its memory go
        if key in _MAPPED:
            _MAPPED.move_to_end(key)
            return _MAPPED[key]
    out = []
    for p in channel["paths"]:
        # from_file would create a missing file: check first, a late receiver must not
        # silently read zeros.
        if not os.path.exists(p) or os.path.getsize(p) != channel["size"]:
            raise PeerError(f"shared buffer {p} is gone: the sender closed or exited")
        out.append(torch.from_file(p, shared=True, size=channel["size"], dtype=torch.uint8))
    with _MAPPED_LOCK:
        _MAPPED[key] = out
        while len(_MAPPED) > _MAX_MAPPED:
            _MAPPED.popitem(last=False)
    return out


class ShmBackend(Backend):
    reach = "host"
    default_bucket_bytes = 8 << 20  # see the README's "Bucket size"

    def __init__(self) -> None:
        self._pair: _ShmPair | None = None

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
        if self._pair is None or self._pair.size != bucket_bytes:
            self.close()
            self._pair = _ShmPair(bucket_bytes)
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
        if self._pair is not None:
            self._pair.close()
            self._pair = None

    @classmethod
    def receive(
        cls, spec: ReceiveSpec, load_weights: LoadWeightsFn, current_version: int | None
    ) -> int:
        return receive_shared(spec, load_weights, current_version, _attach)


register_backend("shm", ShmBackend)

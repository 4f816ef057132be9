"""`shm`: host shared memory between processes on one machine (the CPU path).

The sender maps two files of `bucket_bytes` in the shared-memory filesystem; receivers map
the same files and hand `load_weights` zero-copy views of them. The names are unlinked as
soon as every receiver has mapped them, so a crash leaves nothing behind. Knows nothing about
the devices the weights end up on: `load_weights` copies wherever the model lives.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
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
        self._paths = [
            os.path.join(_shm_dir(), f"offbeat-ckpt-{os.getpid()}-{tag}-{i}") for i in range(2)
        ]
        self._size = bucket_bytes
        self.buffers = [
            torch.from_file(p, shared=True, size=bucket_bytes, dtype=torch.uint8)
            for p in self._paths
        ]

    def describe(self) -> dict[str, Any]:
        return {"paths": list(self._paths), "size": self._size}

    def attached(self) -> None:
        for p in self._paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def close(self) -> None:
        self.attached()
        self.buffers = []


def _attach(channel: dict[str, Any]) -> list[torch.Tensor]:
    out = []
    for p in channel["paths"]:
        # from_file would create a missing file: check first, a late receiver must not
        # silently read zeros.
        if not os.path.exists(p) or os.path.getsize(p) != channel["size"]:
            raise PeerError(
                f"shared buffer {p} is gone: the sender finished or gave up on this receiver"
            )
        out.append(torch.from_file(p, shared=True, size=channel["size"], dtype=torch.uint8))
    return out


class ShmBackend(Backend):
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
        return SharedBufferSender(
            self.name,
            _ShmPair(bucket_bytes),
            version=version,
            num_receivers=num_receivers,
            bucket_bytes=bucket_bytes,
            checksum=checksum,
            timeout_s=timeout_s,
        )

    @classmethod
    def receive(
        cls, spec: ReceiveSpec, load_weights: LoadWeightsFn, current_version: int | None
    ) -> int:
        return receive_shared(spec, load_weights, current_version, _attach)


register_backend("shm", ShmBackend)

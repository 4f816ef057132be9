"""`cuda_ipc`: two GPU bucket buffers shared with receivers on the same GPU or node by CUDA
IPC handles; receivers hand `load_weights` zero-copy views of them.

The handles are opened once per sync (two buffers, not one per tensor: opening handles is
what costs). Knows nothing about which process owns which GPU beyond the device UUID: a
receiver maps the sender's device to its own index by UUID, so differing
CUDA_VISIBLE_DEVICES on the two sides do not matter.
"""

from __future__ import annotations

from typing import Any

import torch

from offbeat.ckpt_engine._shared_buffer import BufferPair, SharedBufferSender, receive_shared
from offbeat.ckpt_engine.errors import PeerError
from offbeat.ckpt_engine.registry import Backend, Sender, register_backend
from offbeat.ckpt_engine.target import LoadWeightsFn, ReceiveSpec

__all__ = ["CudaIpcBackend"]


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class _CudaPair(BufferPair):
    def __init__(self, bucket_bytes: int, device: torch.device) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        self.device = device
        self.buffers = [
            torch.empty(bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)
        ]
        # Keep the IPC descriptors alive with the buffers; the tuple layout is torch's.
        self._handles = [reduce_tensor(b)[1] for b in self.buffers]

    def describe(self) -> dict[str, Any]:
        return {"ipc": list(self._handles), "device_uuid": _uuid(self.device.index)}

    def fence(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self.buffers = []
        self._handles = []


def _local_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if _uuid(i) == uuid:
            return i
    raise PeerError(
        f"the sender's GPU {uuid} is not visible in this process ({torch.cuda.device_count()} visible)"
    )


def _attach(channel: dict[str, Any]) -> list[torch.Tensor]:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise PeerError("cuda_ipc receiver: CUDA is not available in this process")
    index = _local_index(channel["device_uuid"])
    out = []
    for args in channel["ipc"]:
        args = list(args)
        args[6] = index  # storage_device, as seen from this process
        out.append(rebuild_cuda_tensor(*args))
    return out


class CudaIpcBackend(Backend):
    """Options: `device` (default: the current CUDA device) holds the sender's buffers."""

    def __init__(self, device: str | int | torch.device | None = None) -> None:
        self._device = device

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
        return SharedBufferSender(
            self.name,
            _CudaPair(bucket_bytes, device),
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
        device: list[int] = []

        def attach(channel: dict[str, Any]) -> list[torch.Tensor]:
            buffers = _attach(channel)
            device.append(buffers[0].device.index)
            return buffers

        def fence() -> None:
            # load_weights may have queued its copies on any stream of the buffers' device.
            torch.cuda.synchronize(device[0])

        return receive_shared(spec, load_weights, current_version, attach, fence)


register_backend("cuda_ipc", CudaIpcBackend)

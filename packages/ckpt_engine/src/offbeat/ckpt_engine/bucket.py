"""Bucketing shared by every backend: cut a stream of (name, tensor) into buckets of at most
`bucket_bytes`, with exact filled lengths, splitting tensors bigger than what is left of a
bucket and reassembling them on the receiving side.

Knows nothing about how a bucket travels (shared memory, IPC, collectives, files): it plans
pieces, copies them into a flat uint8 buffer, and turns a received buffer back into tensors.
"""

from __future__ import annotations

import zlib
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "ALIGN",
    "Bucket",
    "Entry",
    "Reassembler",
    "as_bytes",
    "checksum",
    "combine",
    "copy_many",
    "dtype_from_str",
    "pack",
    "plan_buckets",
]

# Every piece starts on a 256-byte boundary: any dtype's view is aligned and GPU copies
# stay on full memory transactions.
ALIGN = 256


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_from_str(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dt


@dataclass(frozen=True)
class Entry:
    """One piece of one tensor inside a bucket.

    `offset`/`nbytes` locate the piece in the bucket; `start` is where the piece begins
    within the whole tensor's bytes and `total` is the whole tensor's size in bytes, so a
    tensor split over buckets has several entries with the same name.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    start: int
    total: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.nbytes == self.total

    def to_json(self) -> list:
        return [
            self.name,
            self.dtype,
            list(self.shape),
            self.offset,
            self.nbytes,
            self.start,
            self.total,
        ]

    @classmethod
    def from_json(cls, v: list) -> Entry:
        name, dtype, shape, offset, nbytes, start, total = v
        return cls(name, dtype, tuple(shape), offset, nbytes, start, total)


@dataclass
class Bucket:
    """A planned bucket: its entries, the source bytes of each, and its exact filled length."""

    index: int
    entries: list[Entry]
    sources: list[torch.Tensor]  # flat uint8 views of the sender's tensors, one per entry
    filled: int
    origins: list[torch.Tensor] | None = None  # the tensors as given, one per entry


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (a contiguous copy only if it is strided)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.detach().view(-1).view(torch.uint8)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, first_index: int = 0
) -> Iterator[Bucket]:
    """Yield buckets lazily, pulling the next tensor only when the current one is placed.

    A tensor goes whole into the current bucket if it fits, else into a fresh bucket if it
    fits there; a tensor bigger than a bucket fills what is left and continues in the next
    buckets. Only the tensor being placed is held beyond the buckets being yielded.
    """
    if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes}")
    index = first_index
    entries: list[Entry] = []
    sources: list[torch.Tensor] = []
    origins: list[torch.Tensor] = []
    used = 0

    def flush() -> Bucket:
        nonlocal index, entries, sources, origins, used
        b = Bucket(index, entries, sources, used, origins)
        index, entries, sources, origins, used = index + 1, [], [], [], 0
        return b

    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        src = as_bytes(tensor)
        total = src.numel()
        dtype, shape = _dtype_name(tensor.dtype), tuple(tensor.shape)
        if total > bucket_bytes - _align(used) and total <= bucket_bytes and entries:
            yield flush()
        start = 0
        while True:
            off = _align(used)
            if off >= bucket_bytes:
                yield flush()
                off = 0
            n = min(total - start, bucket_bytes - off)
            entries.append(Entry(name, dtype, shape, off, n, start, total))
            sources.append(src if n == total else src[start : start + n])
            origins.append(tensor)
            used = off + n
            start += n
            if start >= total:
                break
        del src, tensor
    if entries:
        yield flush()


def pack(bucket: Bucket, buffer: torch.Tensor, skip: Container[int] = ()) -> torch.Tensor:
    """Copy a bucket's pieces (but those whose index is in `skip`, which travel another
    way) into `buffer`; return the view of its exact filled length."""
    host = buffer.device.type == "cpu"
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for i, (e, src) in enumerate(zip(bucket.entries, bucket.sources, strict=True)):
        if not e.nbytes or i in skip:
            continue
        dst = buffer[e.offset : e.offset + e.nbytes]
        if host and src.device.type == "cpu":
            # A plain memcpy: torch's copy kernel splits host copies over its thread pool,
            # several times slower than one memcpy when cores are contended.
            np.copyto(dst.numpy(), src.numpy())
        else:
            dsts.append(dst)
            srcs.append(src)
    if dsts:
        copy_many(dsts, srcs)
    return buffer[: bucket.filled]


# Tensors above this size are copied one `copy_` each: launching such a copy takes no more
# host time than the device spends on it, and a plain copy runs at full bandwidth where the
# multi-tensor kernel did not (16 MiB bf16 tensors on an H200: 1540 vs 1327 GB/s).
FUSED_MAX_BYTES = 1 << 20


def copy_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """`dsts[i].copy_(srcs[i])` for every i, queued without waiting: the small tensors in
    one fused multi-tensor copy (a few kernel launches on an accelerator) instead of one host
    call each, which for hundreds of tensors costs more host time than the copies take."""
    small_d: list[torch.Tensor] = []
    small_s: list[torch.Tensor] = []
    for d, s in zip(dsts, srcs, strict=True):
        if d.nbytes > FUSED_MAX_BYTES:
            d.copy_(s, non_blocking=True)
        else:
            small_d.append(d)
            small_s.append(s)
    if len(small_d) > 1:
        try:
            torch._foreach_copy_(small_d, small_s, non_blocking=True)
            return
        except (RuntimeError, TypeError, AttributeError):  # a torch without it, mixed lists
            pass
    for d, s in zip(small_d, small_s, strict=True):
        d.copy_(s, non_blocking=True)


_CHUNK_WORDS = 1 << 22  # 32 MiB of int64 scratch per step


def combine(*checksums: int) -> int:
    """One checksum from several, order-sensitive."""
    c = 0
    for x in checksums:
        c = (c * 1000003 ^ x) & 0xFFFFFFFFFFFFFFFF
    return c


def checksum(view: torch.Tensor) -> int:
    """A per-bucket checksum of a flat uint8 tensor: CRC-32 on the CPU; on an accelerator a
    position-weighted int64 sum computed there (no copy to the host)."""
    if view.device.type == "cpu":
        return zlib.crc32(view.numpy()) if view.numel() else 0
    if view.data_ptr() % 8:  # int64 views need 8-byte alignment
        view = view.clone()
    n8 = view.numel() // 8 * 8
    words = view[:n8].view(torch.int64)
    # Wrap-around int64 sums; the second, weighted by position modulo a prime, catches
    # swapped words that a plain sum would miss. Chunked: bounded scratch memory.
    s1 = s2 = 0
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS]
        w = torch.arange(start, start + chunk.numel(), device=view.device, dtype=torch.int64)
        w = w % 65521 + 1
        s1 += int(chunk.sum())
        s2 += int((chunk * w).sum())
    tail = int(view[n8:].to(torch.int64).sum()) if n8 < view.numel() else 0
    return (s1 ^ (s2 * 31) ^ (tail << 7) ^ view.numel()) & 0xFFFFFFFFFFFFFFFF


class Reassembler:
    """Turns received buckets back into (name, tensor) pairs.

    Whole tensors are zero-copy views of the bucket; a split tensor is collected in one
    fresh tensor and released once its last piece arrives. At most one split tensor is in
    flight at a time, so the extra memory is bounded by one tensor.
    """

    def __init__(self) -> None:
        self._pending: dict[str, torch.Tensor] = {}
        self._filled: dict[str, int] = {}

    def take(
        self,
        entries: list[Entry],
        view: torch.Tensor,
        ext: Mapping[int, torch.Tensor] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Tensors completed by this bucket. Entry `i` reads from `ext[i]` when given (a
        piece shared in place by the sender), else from `view` at its offset."""
        out: list[tuple[str, torch.Tensor]] = []
        for i, e in enumerate(entries):
            dtype = dtype_from_str(e.dtype)
            piece = ext[i] if ext and i in ext else view[e.offset : e.offset + e.nbytes]
            if e.whole:
                out.append(
                    (
                        e.name,
                        piece.view(dtype).view(e.shape)
                        if e.nbytes
                        else torch.empty(e.shape, dtype=dtype, device=view.device),
                    )
                )
                continue
            buf = self._pending.get(e.name)
            if buf is None:
                buf = self._pending[e.name] = torch.empty(
                    e.total, dtype=torch.uint8, device=view.device
                )
                self._filled[e.name] = 0
            buf[e.start : e.start + e.nbytes].copy_(piece)
            self._filled[e.name] += e.nbytes
            if self._filled[e.name] == e.total:
                del self._pending[e.name], self._filled[e.name]
                out.append((e.name, buf.view(dtype).view(e.shape)))
        return out

    def finish(self) -> None:
        """Raise if a split tensor never got all its pieces."""
        if self._pending:
            missing = ", ".join(
                f"{n} ({self._filled[n]}/{t.numel()} bytes)" for n, t in self._pending.items()
            )
            self._pending.clear()
            from offbeat.ckpt_engine.errors import PeerError

            raise PeerError(f"stream ended with incomplete tensors: {missing}")

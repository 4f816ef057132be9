"""`naive`: sender and receivers in one process; `load_weights` copies straight from the
sender's tensors, no staging buffer.

Buckets are still formed (lists of whole tensors up to `bucket_bytes`) and at most two are
outstanding per receiver, so memory and pacing match the other backends. The spec only
names an in-process session, so it does not cross process boundaries. Checksums are
ignored: nothing is copied in transit that could be corrupted.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from typing import Any

import torch

from offbeat.ckpt_engine._shared_buffer import check_version
from offbeat.ckpt_engine.errors import PeerError, StaleVersionError, SyncTimeoutError
from offbeat.ckpt_engine.registry import Backend, NamedTensors, Sender, SendReport, register_backend
from offbeat.ckpt_engine.target import LoadWeightsFn, ReceiveSpec

__all__ = ["NaiveBackend"]

_SESSIONS: dict[str, _NaiveSender] = {}
_END = object()


class _NaiveSender(Sender):
    def __init__(self, version: int, n: int, bucket_bytes: int, timeout_s: float) -> None:
        self.key = secrets.token_hex(8)
        self._version, self._n, self._bucket_bytes, self._timeout = (
            version,
            n,
            bucket_bytes,
            timeout_s,
        )
        self.queues = [queue.Queue(maxsize=2) for _ in range(n)]
        self.failed: dict[int, str] = {}
        self.done: set[int] = set()
        self._cond = threading.Condition()
        _SESSIONS[self.key] = self

    def spec(self, rank: int) -> ReceiveSpec:
        return ReceiveSpec(
            "naive", self._version, {"session": self.key}, rank, False, self._timeout
        )

    def fail(self, rank: int, reason: str) -> None:
        with self._cond:
            self.failed.setdefault(rank, reason)
            self._cond.notify_all()

    def drop(self, rank: int, reason: str) -> None:
        self.fail(rank, reason)

    def abort(self, reason: str) -> None:
        for r in range(self._n):
            self.fail(r, reason)

    def _put(self, item: Any) -> None:
        for r, q in enumerate(self.queues):
            deadline = time.monotonic() + self._timeout
            while r not in self.failed:
                try:
                    q.put(item, timeout=0.05)
                    break
                except queue.Full:
                    if time.monotonic() > deadline:
                        self.fail(r, f"receiver {r} took no bucket within {self._timeout:.1f}s")

    def _buckets(self, named_tensors: NamedTensors):
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in named_tensors:
            n = t.numel() * t.element_size()
            if bucket and size + n > self._bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t.detach()))
            size += n
        if bucket:
            yield bucket

    def send(self, named_tensors: NamedTensors) -> SendReport:
        t0 = time.perf_counter()
        report = SendReport()
        try:
            for bucket in self._buckets(named_tensors):
                if len(self.failed) == self._n:
                    break
                self._put(bucket)
                report.buckets += 1
                report.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            self._put(_END)
            deadline = time.monotonic() + self._timeout
            with self._cond:
                while len(self.done | set(self.failed)) < self._n:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        for r in range(self._n):
                            if r not in self.done:
                                self.failed.setdefault(
                                    r, f"receiver {r} did not finish within {self._timeout:.1f}s"
                                )
                        break
                    self._cond.wait(left)
        except BaseException as e:
            self.abort(f"sender failed: {type(e).__name__}: {e}")
            raise
        finally:
            _SESSIONS.pop(self.key, None)
        report.failed = dict(self.failed)
        report.seconds = time.perf_counter() - t0
        return report


class NaiveBackend(Backend):
    reach = "process"

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
        return _NaiveSender(version, num_receivers, bucket_bytes, timeout_s)

    @classmethod
    def receive(
        cls, spec: ReceiveSpec, load_weights: LoadWeightsFn, current_version: int | None
    ) -> int:
        session = _SESSIONS.get(spec.channel.get("session", ""))
        if session is None:
            raise PeerError(
                "naive backend: no sender session in this process (naive works only in-process)"
            )
        rank = spec.rank
        q = session.queues[rank]
        try:
            check_version(spec, current_version)
            while True:
                if rank in session.failed:
                    raise PeerError(f"sync aborted: {session.failed[rank]}")
                deadline = time.monotonic() + spec.timeout_s
                while True:  # short slices: an abort is noticed at once
                    try:
                        item = q.get(timeout=0.05)
                        break
                    except queue.Empty:
                        if rank in session.failed:
                            raise PeerError(f"sync aborted: {session.failed[rank]}") from None
                        if time.monotonic() > deadline:
                            raise SyncTimeoutError(
                                f"no bucket from the sender within {spec.timeout_s:.1f}s"
                            ) from None
                if item is _END:
                    with session._cond:
                        session.done.add(rank)
                        session._cond.notify_all()
                    return spec.version
                load_weights(item)
        except BaseException as e:
            reason = str(e) if isinstance(e, StaleVersionError) else f"{type(e).__name__}: {e}"
            session.fail(rank, reason)
            # Unblock a sender waiting on this queue.
            while not q.empty():
                q.get_nowait()
            raise


register_backend("naive", NaiveBackend)

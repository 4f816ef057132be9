"""The streaming protocol of backends whose two bucket buffers are mapped by sender and
receivers alike (host shared memory, CUDA IPC): metadata and acks over the control channel,
bytes through the shared buffers.

Knows nothing about how buffers are allocated or attached; a `BufferPair` does that. The
invariant it keeps: a buffer is refilled only after every live receiver acknowledged the
bucket it held, and a receiver acknowledges only after `load_weights` returned and its
copies finished.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
import weakref
from abc import ABC, abstractmethod
from typing import Any

import torch

from offbeat.ckpt_engine._reuse import Replay, ViewCache
from offbeat.ckpt_engine._wire import Conn, Listener, connect, encode
from offbeat.ckpt_engine.bucket import (
    Reassembler,
    checksum,
    combine,
    pack,
    plan_buckets,
)
from offbeat.ckpt_engine.errors import ChecksumError, PeerError, StaleVersionError
from offbeat.ckpt_engine.registry import NamedTensors, Sender, SendReport
from offbeat.ckpt_engine.target import LoadWeightsFn, ReceiveSpec


class BufferPair(ABC):
    """The sender's two buffers and how a receiver finds them."""

    buffers: list[torch.Tensor]
    # Leading buckets of the last sync that were read wholly in place (see Replay).
    replays: list[Replay]

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Picklable data a receiver attaches with."""

    def fence(self) -> None:  # noqa: B027
        """Make the bytes just packed visible to other processes."""

    def share(self, piece: torch.Tensor) -> tuple[Any, int] | None:
        """Optionally let receivers read `piece` where it lies instead of packing it:
        (storage key, byte offset of the piece in that storage)."""
        return None

    def descriptor(self, key: Any) -> str:
        """The plain-string descriptor receivers open the storage `key` (from `share`) with;
        the same string for the same storage across syncs, so receivers can keep what they
        opened."""
        raise NotImplementedError

    def keep(self, keys: list) -> None:  # noqa: B027
        """Storages (keys from `share`) used again by a replayed bucket in this sync."""

    def attached(self) -> None:  # noqa: B027
        """Every receiver has attached (names may be unlinked now)."""

    def release(self) -> None:  # noqa: B027
        """The sync that used the buffers is over (they may be kept for the next one)."""

    def close(self) -> None:  # noqa: B027
        """Free the buffers."""


class SharedBufferSender(Sender):
    def __init__(
        self,
        backend: str,
        pair: BufferPair,
        *,
        version: int,
        num_receivers: int,
        bucket_bytes: int,
        checksum: bool,
        timeout_s: float,
        host: str = "127.0.0.1",
    ) -> None:
        self._backend, self._pair = backend, pair
        self._version, self._n = version, num_receivers
        self._bucket_bytes, self._checksum, self._timeout = bucket_bytes, checksum, timeout_s
        self._listener = Listener(host)
        self._token = secrets.token_hex(16)
        self._conns: dict[int, Conn] = {}
        self._failed: dict[int, str] = {}
        self._lock = threading.Lock()
        self._aborted: str | None = None
        self._storage_ids: dict[Any, int] = {}
        self._held: list[list[torch.Tensor] | None] = [None, None]
        # Per slot: the index of the bucket it holds that is not yet acked, or None.
        self._awaiting: list[int | None] = [None, None]
        self._next_slot = 0
        # Pieces of buckets read wholly in place (no buffer, no ack): alive until "done".
        self._held_in_place: list[torch.Tensor] = []

    def spec(self, rank: int) -> ReceiveSpec:
        channel = {
            "address": list(self._listener.address),
            "token": self._token,
            "bucket_bytes": self._bucket_bytes,
        }
        channel.update(self._pair.describe())
        return ReceiveSpec(
            self._backend, self._version, channel, rank, self._checksum, self._timeout
        )

    # -- failure bookkeeping (thread-safe: the manager calls drop/abort from its loop) --
    def _fail(self, rank: int, reason: str) -> None:
        with self._lock:
            self._failed.setdefault(rank, reason)
            conn = self._conns.pop(rank, None)
        if conn is not None:
            conn.close()

    def drop(self, rank: int, reason: str) -> None:
        self._fail(rank, reason)

    def abort(self, reason: str) -> None:
        self._aborted = reason
        for _rank, conn in self._live():
            with contextlib.suppress(PeerError):
                conn.send({"type": "abort", "reason": reason})
        for rank in range(self._n):
            self._fail(rank, reason)
        self._listener.close()

    def _live(self) -> list[tuple[int, Conn]]:
        with self._lock:
            return sorted(self._conns.items())

    def _accept(self) -> None:
        deadline = time.monotonic() + self._timeout
        while len(self._conns) + len(self._failed) < self._n and self._aborted is None:
            conn = self._listener.accept(min(deadline, time.monotonic() + 0.2))
            if conn is None:
                if time.monotonic() >= deadline:
                    break
                continue
            try:
                hello = conn.recv(self._timeout)
            except PeerError:
                conn.close()
                continue
            rank = hello.get("rank")
            if (
                hello.get("token") != self._token
                or not isinstance(rank, int)
                or not 0 <= rank < self._n
            ):
                conn.close()
                continue
            if hello.get("refuse"):
                conn.close()
                self._fail(rank, hello["refuse"])
                continue
            with self._lock:
                if rank in self._failed or rank in self._conns:
                    conn.close()
                    continue
                self._conns[rank] = conn
        for rank in range(self._n):
            if rank not in self._conns:
                self._fail(rank, f"receiver {rank} did not connect within {self._timeout:.1f}s")
        self._listener.close()
        self._pair.attached()

    def _wait_acks(self, index: int, kind: str = "ack") -> None:
        for rank, conn in self._live():
            try:
                msg = conn.recv(self._timeout)
            except PeerError as e:
                self._fail(rank, f"receiver {rank} failed during bucket {index}: {e}")
                continue
            if msg.get("type") == "error":
                self._fail(rank, msg.get("reason", "receiver reported an error"))
            elif msg.get("type") != kind or (kind == "ack" and msg.get("index") != index):
                self._fail(
                    rank, f"receiver {rank} broke the protocol: expected {kind} {index}, got {msg}"
                )

    def _share(self, bucket) -> tuple[dict[int, list[int]], dict[str, str]]:
        """Entries receivers read in place: index -> [storage id, byte offset]; plus the
        descriptors of storages not yet announced in this sync."""
        ext: dict[int, list[int]] = {}
        new: dict[str, str] = {}
        for i, (e, src) in enumerate(zip(bucket.entries, bucket.sources, strict=True)):
            shared = self._pair.share(src) if e.nbytes else None
            if shared is None:
                continue
            key, offset = shared
            sid = self._storage_ids.get(key)
            if sid is None:
                sid = self._storage_ids[key] = len(self._storage_ids)
                new[str(sid)] = self._pair.descriptor(key)
            ext[i] = [sid, offset]
        return ext, new

    def _publish(self, msg: dict[str, Any] | bytes) -> None:
        if not isinstance(msg, bytes):
            msg = encode(msg)
        for rank, conn in self._live():
            try:
                conn.send(msg)
            except PeerError as e:
                self._fail(rank, f"receiver {rank}: {e}")

    def _buckets(self, named_tensors: NamedTensors):
        """(index, a freshly planned bucket or None, a replay or None, its tensors)."""
        it = iter(named_tensors)
        replays = getattr(self._pair, "replays", None) or []
        self._pair.replays = []
        index = 0
        for r in [] if self._checksum else replays:
            taken, same = r.take(it)
            if not same:  # a different stream from here on: plan it
                it = itertools.chain(taken, it)
                break
            self._pair.keep(r.keys)
            self._storage_ids.update(r.sids)
            self._pair.replays.append(r)
            yield index, None, r, [t for _, t in taken]
            index += 1
        for bucket in plan_buckets(it, self._bucket_bytes, first_index=index):
            yield bucket.index, bucket, None, None

    def _remember(self, bucket, msg: dict, raw: bytes, ext: dict) -> None:
        """Keep a bucket read wholly in place (and all before it) for replaying."""
        if (
            self._checksum
            or not msg.get("noack")  # a replay is never acked
            or len(self._pair.replays) != bucket.index
            or len(ext) != len(bucket.entries)
            or not all(e.whole for e in bucket.entries)
        ):
            return
        keys = [self._pair.share(src)[0] for src in bucket.sources]
        tensors = [
            (e.name, weakref.ref(t), t.data_ptr())
            for e, t in zip(bucket.entries, bucket.origins, strict=True)
        ]
        sids = {k: self._storage_ids[k] for k in keys}
        self._pair.replays.append(Replay(tensors, msg, raw, keys, sids))

    def send(self, named_tensors: NamedTensors) -> SendReport:
        t0 = time.perf_counter()
        report = SendReport()
        try:
            self._accept()
            for _index, bucket, replay, tensors in self._buckets(named_tensors):
                if not self._live():
                    break
                if replay is not None:
                    self._pair.fence()  # the trainer's writes to those tensors are done
                    self._held_in_place.extend(tensors)
                    self._publish(replay.raw)
                    report.buckets += 1
                    report.bytes += replay.msg["filled"]
                    continue
                ext, storages = self._share(bucket)
                # A bucket read wholly in place (no checksum over a buffer) uses no buffer:
                # nothing to give back, so receivers do not ack it; they sync their copies
                # once before "done", and its pieces stay held until then.
                in_place = not self._checksum and bool(ext) and len(ext) == len(bucket.entries)
                slot = self._next_slot
                if not in_place:
                    self._next_slot ^= 1
                    if self._awaiting[slot] is not None:
                        self._wait_acks(self._awaiting[slot])
                        self._awaiting[slot] = None
                view = pack(bucket, self._pair.buffers[slot], skip=ext)
                self._pair.fence()
                msg = {
                    "type": "bucket",
                    "index": bucket.index,
                    "slot": slot,
                    "filled": bucket.filled,
                    "entries": [e.to_json() for e in bucket.entries],
                    "checksum": None,
                }
                if ext:
                    msg["ext"] = {str(i): v for i, v in ext.items()}
                    msg["storages"] = storages
                if in_place:
                    msg["noack"] = True
                    self._held_in_place.extend(bucket.sources)
                else:
                    # Pieces read in place must stay alive until this bucket is acked.
                    self._held[slot] = [bucket.sources[i] for i in ext] or None
                if self._checksum:
                    msg["checksum"] = combine(
                        checksum(view), *(checksum(bucket.sources[i]) for i in ext)
                    )
                raw = encode(msg)
                if not self._checksum:
                    self._remember(bucket, msg, raw, ext)
                del bucket, view
                self._publish(raw)
                if not in_place:
                    self._awaiting[slot] = msg["index"]
                report.buckets += 1
                report.bytes += msg["filled"]
            for index in sorted(i for i in self._awaiting if i is not None):
                self._wait_acks(index)
            self._awaiting = [None, None]
            self._publish({"type": "end", "buckets": report.buckets})
            self._wait_acks(report.buckets, kind="done")
        except BaseException as e:
            self.abort(f"sender failed: {type(e).__name__}: {e}")
            raise
        finally:
            for _rank, conn in self._live():
                conn.close()
            self._held = [None, None]
            self._awaiting = [None, None]
            self._held_in_place = []
            self._pair.release()
            self._listener.close()
        if self._aborted is not None:
            for rank in range(self._n):
                self._failed.setdefault(rank, self._aborted)
        report.failed = dict(self._failed)
        report.seconds = time.perf_counter() - t0
        return report


def check_version(spec: ReceiveSpec, current_version: int | None) -> None:
    if current_version is not None and spec.version < current_version:
        raise StaleVersionError(spec.version, current_version)


def receive_shared(
    spec: ReceiveSpec,
    load_weights: LoadWeightsFn,
    current_version: int | None,
    attach,
    mark=lambda: None,
    open_storage=None,
) -> int:
    """The receiver's loop: attach the buffers, then load and ack bucket after bucket.

    `mark()` is called after each `load_weights`; it returns None once the copies out of the
    bucket are done (host memory), or an object whose `synchronize()` waits for them (a
    device event). Then the ack is held back while the next bucket is already there, so the
    device copies of one bucket overlap launching the next; it is sent before blocking.
    """
    ch = spec.channel
    stale: StaleVersionError | None = None
    try:
        check_version(spec, current_version)
    except StaleVersionError as e:
        stale = e
    buffers = None if stale else attach(ch)
    conn = connect(ch["address"], spec.timeout_s)
    views = ViewCache.get(f"{spec.backend}/{spec.rank}")
    try:
        hello: dict[str, Any] = {"token": ch["token"], "rank": spec.rank}
        if stale is not None:
            hello["refuse"] = str(stale)
            conn.send(hello)
            raise stale
        conn.send(hello)
        reasm = Reassembler()
        storages: dict[int, torch.Tensor] = {}
        expected = 0
        pending: tuple[int, Any] | None = None
        unacked = False  # copies of buckets read wholly in place, not yet waited for

        def flush() -> None:
            nonlocal pending
            if pending is not None:
                index, event = pending
                pending = None
                event.synchronize()  # copies out of the bucket done before giving it back
                conn.send({"type": "ack", "index": index})

        while True:
            if pending is not None and not conn.ready():
                flush()  # never block while holding an ack the sender may wait for
            # Before the first bucket the sender may spend a whole timeout waiting for
            # other receivers to connect.
            raw = conn.recv_raw(spec.timeout_s * (2 if expected == 0 else 1))
            # A bucket read wholly in place comes again byte for byte in the next sync of
            # the same stream (a replay): reuse what was decoded then.
            msg = views.decoded(expected, raw)
            kind = msg.get("type")
            if kind == "abort":
                raise PeerError(f"the sender aborted the sync: {msg.get('reason')}")
            if kind == "end":
                flush()
                if unacked:
                    event = mark()
                    if event is not None:
                        event.synchronize()  # every copy done before reporting the version
                if msg["buckets"] != expected:
                    raise PeerError(
                        f"sender ended after {msg['buckets']} buckets, received {expected}"
                    )
                reasm.finish()
                conn.send({"type": "done", "version": spec.version})
                return spec.version
            if kind != "bucket" or msg["index"] != expected:
                raise PeerError(f"expected bucket {expected}, got {msg}")
            view = buffers[msg["slot"]][: msg["filled"]]
            for sid, blob in msg.get("storages", {}).items():
                if open_storage is None:
                    raise PeerError(
                        "the sender shared storages in place; this backend cannot open them"
                    )
                storages[int(sid)] = open_storage(blob)
            entries = msg["entries"]
            ext_raw = msg.get("ext", {})
            ext_at = {int(i): (storages[sid], off) for i, (sid, off) in ext_raw.items()}
            if spec.checksum:
                got = combine(
                    checksum(view),
                    *(checksum(b[o : o + entries[i][4]]) for i, (b, o) in sorted(ext_at.items())),
                )
                if got != msg["checksum"]:
                    err = ChecksumError(msg["index"], msg["checksum"], got)
                    conn.send({"type": "error", "reason": str(err)})
                    raise err
            tensors = views.take(entries, buffers[msg["slot"]], ext_at, reasm, ext_raw)
            if tensors:
                load_weights(tensors)
            del tensors, view
            if msg.get("noack"):
                # Read wholly in place: no buffer to give back, so no event and no ack.
                unacked = True
                expected += 1
                continue
            event = mark()
            flush()  # the previous bucket: its copies were queued before this one's
            if event is None:
                conn.send({"type": "ack", "index": expected})
            else:
                pending = (expected, event)
            expected += 1
    finally:
        conn.close()
        views.trim()

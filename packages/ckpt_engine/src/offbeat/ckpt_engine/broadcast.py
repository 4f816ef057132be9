"""`broadcast`: buckets go out by torch.distributed broadcast over a process group built for
the sync: gloo for CPU tensors (testable anywhere), nccl for CUDA, the device's registered
backend elsewhere (e.g. hccl).

Rank layout, fixed: senders 0..S-1, then receivers in the manager's member order. The group
is built once per membership (all ranks rendezvous through a TCPStore hosted by sender 0,
with a timeout) and reused while the membership is unchanged; a failed collective drops it
and the next sync builds a fresh one. Bucket metadata travels through the store, bytes
through the collective, exactly `filled` bytes per bucket. With several senders (a sharded
trainer), each streams its own shard in rank order; other senders also receive those
buckets, which they discard. Knows nothing about the trainer's own process groups: it never
touches the default group.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from offbeat.ckpt_engine import compat
from offbeat.ckpt_engine._shared_buffer import check_version
from offbeat.ckpt_engine.bucket import Entry, Reassembler, checksum, pack, plan_buckets
from offbeat.ckpt_engine.errors import ChecksumError, PeerError, StaleVersionError, SyncTimeoutError
from offbeat.ckpt_engine.registry import Backend, NamedTensors, Sender, SendReport, register_backend
from offbeat.ckpt_engine.target import LoadWeightsFn, ReceiveSpec

__all__ = ["BroadcastBackend", "send_shard"]


class _Group:
    """A process group and the store it was built through, for one membership."""

    def __init__(self, store: dist.Store, key: str, backend: str, rank: int, world: int) -> None:
        self.store, self.key, self.backend, self.rank, self.world = store, key, backend, rank, world
        self.pg = None

    def build(self, timeout_s: float) -> _Group:
        if self.pg is None:
            self.pg = compat.new_process_group(
                self.store, self.key, self.backend, self.rank, self.world, timeout_s
            )
        return self

    def broadcast(self, t: torch.Tensor, root: int):
        return compat.broadcast(self.pg, t, root)


# Groups this process joined as a receiver or extra sender, keyed by (store, group key, rank).
_JOINED: dict[tuple, _Group] = {}
_JOINED_LOCK = threading.Lock()


def _join(ch: dict[str, Any], rank: int, timeout_s: float) -> _Group:
    k = (tuple(ch["store"]), ch["group"], rank)
    with _JOINED_LOCK:
        g = _JOINED.get(k)
    if g is None:
        host, port = ch["store"]
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        g = _Group(store, ch["group"], ch["pg_backend"], rank, ch["world"]).build(timeout_s)
        with _JOINED_LOCK:
            # Drop groups of an older membership with the same store: they are never reused.
            for old in [o for o in _JOINED if o[0] == k[0] and o[2] == rank]:
                del _JOINED[old]
            _JOINED[k] = g
    return g


def _forget(ch: dict[str, Any], rank: int) -> None:
    with _JOINED_LOCK:
        _JOINED.pop((tuple(ch["store"]), ch["group"], rank), None)


def _wait(work, timeout_s: float, what: str) -> None:
    try:
        work.wait(timedelta(seconds=timeout_s))
    except Exception as e:
        raise PeerError(f"broadcast of {what} failed: {e}") from e


def _order(work, device: torch.device, timeout_s: float, what: str) -> None:
    """Make what follows wait for `work`. On an accelerator the current stream waits for
    it and the host goes on (a wait with a timeout polls the host at millisecond steps: a
    bubble per bucket); the last bucket is still waited for on the host, with the timeout.
    On CPU the host waits."""
    if device.type == "cpu":
        _wait(work, timeout_s, what)
    else:
        try:
            work.wait()
        except Exception as e:
            raise PeerError(f"broadcast of {what} failed: {e}") from e


def _stream(
    g: _Group,
    ch: dict[str, Any],
    named_tensors: NamedTensors | None,
    load_weights,
    timeout_s: float,
    verify: bool,
) -> tuple[int, int, Exception | None]:
    """Every rank's loop over the senders' streams. Returns (bytes, buckets, deferred error).

    A receiver that must not apply the sync (stale, corrupt bucket) keeps taking part in the
    collectives, so the other ranks are not left hanging, and reports its error at the end.
    """
    device = torch.device(ch["device"])
    nbytes = nbuckets = 0
    error: Exception | None = None
    buffers: list[torch.Tensor] = []
    prefix = f"{ch['group']}/{ch['sync']}"
    g.store.set_timeout(timedelta(seconds=timeout_s))

    def buffer(slot: int) -> torch.Tensor:
        while len(buffers) <= slot:
            buffers.append(torch.empty(ch["bucket_bytes"], dtype=torch.uint8, device=device))
        return buffers[slot]

    for s in range(ch["num_senders"]):
        if g.rank == s:
            works: list[Any] = [None, None]
            k = 0
            try:
                for bucket in plan_buckets(named_tensors or (), ch["bucket_bytes"]):
                    slot = k % 2
                    if works[slot] is not None:  # the collective that read this buffer is done
                        _order(works[slot], device, timeout_s, f"bucket {k - 2} of sender {s}")
                    view = pack(bucket, buffer(slot))
                    meta = {
                        "filled": bucket.filled,
                        "entries": [e.to_json() for e in bucket.entries],
                    }
                    if ch["checksum"]:
                        meta["checksum"] = checksum(view)
                    del bucket
                    g.store.set(f"{prefix}/s{s}/b{k}", json.dumps(meta))
                    works[slot] = g.broadcast(view, s)
                    nbytes += meta["filled"]
                    nbuckets += 1
                    k += 1
            except Exception as e:
                # Receivers wait on this key: tell them now rather than at their timeout.
                reason = f"sender {s} failed: {type(e).__name__}: {e}"
                g.store.set(f"{prefix}/s{s}/b{k}", json.dumps({"abort": reason}))
                # Let the buckets already posted complete, so receivers reach the abort
                # key instead of a collective torn down under them.
                for w in works:
                    if w is not None:
                        with contextlib.suppress(Exception):
                            _wait(w, timeout_s, "a posted bucket")
                raise
            g.store.set(f"{prefix}/s{s}/b{k}", json.dumps({"end": True}))
            for w in works:
                if w is not None:
                    _wait(w, timeout_s, f"the last buckets of sender {s}")
            continue
        reasm = Reassembler()

        def post(k: int, s: int = s):
            """Fetch bucket k's metadata and post its receive into buffer k % 2."""
            try:
                meta = json.loads(g.store.get(f"{prefix}/s{s}/b{k}"))
            except Exception as err:
                raise SyncTimeoutError(
                    f"no bucket {k} from sender {s} within {timeout_s:.1f}s ({err})"
                ) from err
            if "abort" in meta:
                raise PeerError(f"the sender aborted the sync: {meta['abort']}")
            if meta.get("end"):
                return meta, None, None
            view = buffer(k % 2)[: meta["filled"]]
            return meta, view, g.broadcast(view, s)

        # Two receives in flight: bucket k+1 lands in the other buffer while bucket k is
        # loaded, and k+2 is posted into k's buffer once k's copies are queued: on a GPU
        # the collective stream waits for them (the host does not), on CPU they are done.
        k = 0
        inflight = [post(0, s)]
        if inflight[0][2] is not None:
            inflight.append(post(1, s))
        last = None
        while inflight[0][2] is not None:
            meta, view, last = inflight.pop(0)
            _order(last, device, timeout_s, f"bucket {k} of sender {s}")
            if load_weights is not None and error is None:
                if verify and "checksum" in meta and (got := checksum(view)) != meta["checksum"]:
                    error = ChecksumError(k, meta["checksum"], got)
                else:
                    tensors = reasm.take([Entry.from_json(e) for e in meta["entries"]], view)
                    if tensors:
                        load_weights(tensors)
                    del tensors
            if inflight[-1][2] is not None:
                inflight.append(post(k + 2, s))
            k += 1
        if last is not None and device.type != "cpu":
            _wait(last, timeout_s, f"bucket {k - 1} of sender {s}")
            torch.get_device_module(device.type).synchronize(device)  # the copies landed
        if load_weights is not None and error is None:
            reasm.finish()
    return nbytes, nbuckets, error


class _BroadcastSender(Sender):
    def __init__(
        self,
        backend: BroadcastBackend,
        group: _Group,
        channel: dict[str, Any],
        version: int,
        n: int,
        checksum: bool,
        timeout_s: float,
    ) -> None:
        self._backend, self._group, self._ch = backend, group, channel
        self._version, self._n, self._checksum, self._timeout = version, n, checksum, timeout_s
        self._failed: dict[int, str] = {}

    def spec(self, rank: int) -> ReceiveSpec:
        return ReceiveSpec(
            "broadcast", self._version, dict(self._ch), rank, self._checksum, self._timeout
        )

    def sender_channel(self) -> dict[str, Any]:
        """What extra sender ranks (1..num_senders-1) pass to `send_shard`."""
        return dict(self._ch)

    def drop(self, rank: int, reason: str) -> None:
        self._failed.setdefault(rank, reason)

    def abort(self, reason: str) -> None:
        for r in range(self._n):
            self._failed.setdefault(r, reason)

    def send(self, named_tensors: NamedTensors) -> SendReport:
        t0 = time.perf_counter()
        g = self._group
        done_keys = [f"{self._ch['group']}/{self._ch['sync']}/done/{r}" for r in range(self._n)]
        try:
            g.build(self._timeout)
            nbytes, nbuckets, _ = _stream(g, self._ch, named_tensors, None, self._timeout, False)
            self._wait_done(g.store, done_keys, self._timeout)
        except Exception as e:
            self._backend._drop_group()
            # Receivers may still be reading the bucket keys (the abort key among them):
            # deleting them under a reader hands it an empty value instead of the reason.
            # Wait, briefly, for their final status before the cleanup below.
            with contextlib.suppress(Exception):
                self._wait_done(g.store, done_keys, min(self._timeout, 10.0))
            for r in range(self._n):
                self._failed.setdefault(r, f"broadcast failed, the group is rebuilt next sync: {e}")
            return SendReport(0, 0, time.perf_counter() - t0, dict(self._failed))
        finally:
            self._cleanup()
        return SendReport(nbytes, nbuckets, time.perf_counter() - t0, dict(self._failed))

    def _wait_done(self, store: dist.Store, done_keys: list[str], timeout_s: float) -> None:
        """Every receiver's final status; one the manager saw die is not waited for."""
        deadline = time.monotonic() + timeout_s
        pending = dict(enumerate(done_keys))
        while pending:
            for r, key in list(pending.items()):
                if r in self._failed:
                    del pending[r]
                elif store.check([key]):
                    status = store.get(key).decode()
                    if status != "ok":
                        self._failed.setdefault(r, status)
                    del pending[r]
            if pending and time.monotonic() > deadline:
                for r in pending:
                    self._failed.setdefault(
                        r, f"receiver {r} did not finish within {timeout_s:.1f}s"
                    )
                return
            if pending:
                # Block on one pending key (woken the moment it is set) rather than sleep:
                # a fixed 20 ms sleep added up to 20 ms to a sync that takes ~50 ms on GPUs.
                # The bound keeps noticing receivers the manager saw die.
                with contextlib.suppress(Exception):
                    store.wait([next(iter(pending.values()))], timedelta(milliseconds=20))

    def _cleanup(self) -> None:
        prefix = f"{self._ch['group']}/{self._ch['sync']}"
        for key in [f"{prefix}/done/{r}" for r in range(self._n)]:
            with contextlib.suppress(Exception):
                self._group.store.delete_key(key)
        for s in range(self._ch["num_senders"]):
            k = 0
            while True:
                try:
                    if not self._group.store.delete_key(f"{prefix}/s{s}/b{k}"):
                        break
                except Exception:
                    break
                k += 1


class BroadcastBackend(Backend):
    """Options: `device` ("cpu" -> gloo, "cuda" -> nccl, ...), `host` (address receivers
    reach the store at; default 127.0.0.1), `num_senders` (trainer ranks that each stream a
    shard, default 1; ranks 1.. call `send_shard`)."""

    def __init__(self, device: str = "cpu", host: str = "127.0.0.1", num_senders: int = 1) -> None:
        self.device = torch.device(device)
        self.host, self.num_senders = host, num_senders
        self._pg_backend = compat.process_group_backend(self.device)
        self._store: dist.TCPStore | None = None
        self._group: _Group | None = None
        self._members: tuple[str, ...] | None = None
        self._sync = 0

    def _drop_group(self) -> None:
        self._group, self._members = None, None

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
        if self._store is None:
            self._store = dist.TCPStore(
                self.host,
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
            )
        members = members or tuple(str(i) for i in range(num_receivers))
        if self._group is None or self._members != members:
            # Built lazily in send(): every rank must reach the rendezvous at the same time.
            key = f"{secrets.token_hex(4)}-{len(members)}"
            self._group = _Group(
                self._store, key, self._pg_backend, 0, self.num_senders + num_receivers
            )
            self._members = members
        self._sync += 1
        channel = {
            "store": [self.host, self._store.port],
            "group": self._group.key,
            "sync": self._sync,
            "world": self._group.world,
            "num_senders": self.num_senders,
            "pg_backend": self._pg_backend,
            "device": self.device.type,
            "bucket_bytes": bucket_bytes,
            "checksum": checksum,
        }
        return _BroadcastSender(
            self, self._group, channel, version, num_receivers, checksum, timeout_s
        )

    def close(self) -> None:
        self._drop_group()
        self._store = None

    @classmethod
    def receive(
        cls, spec: ReceiveSpec, load_weights: LoadWeightsFn, current_version: int | None
    ) -> int:
        ch = spec.channel
        rank = ch["num_senders"] + spec.rank
        status = "ok"
        g: _Group | None = None
        try:
            stale: StaleVersionError | None = None
            try:
                check_version(spec, current_version)
            except StaleVersionError as e:
                stale = e
            g = _join(ch, rank, spec.timeout_s)
            _, _, error = _stream(
                g, ch, None, None if stale else load_weights, spec.timeout_s, spec.checksum
            )
            error = stale or error
            if error is not None:
                status = f"{type(error).__name__}: {error}"
                raise error
            return spec.version
        except (PeerError, SyncTimeoutError) as e:
            _forget(ch, rank)
            status = str(e)
            raise
        except Exception as e:
            if status == "ok":
                status = f"{type(e).__name__}: {e}"
            raise
        finally:
            # The group may be forgotten already (a failed collective): its store still
            # reaches the sender, which waits for this status before cleaning up.
            if g is not None:
                with contextlib.suppress(Exception):
                    g.store.set(f"{ch['group']}/{ch['sync']}/done/{spec.rank}", status)


def send_shard(
    channel: dict[str, Any], sender_rank: int, named_tensors: NamedTensors, timeout_s: float = 300.0
) -> SendReport:
    """Run on trainer rank `sender_rank` (1..num_senders-1) to stream its shard in a sync
    whose channel rank 0's manager produced (`ReceiveSpec.channel` of any receiver)."""
    if not 0 < sender_rank < channel["num_senders"]:
        raise ValueError(
            f"sender_rank must be in 1..{channel['num_senders'] - 1}, got {sender_rank}"
        )
    t0 = time.perf_counter()
    g = _join(channel, sender_rank, timeout_s)
    try:
        nbytes, nbuckets, _ = _stream(g, channel, named_tensors, None, timeout_s, False)
    except Exception:
        _forget(channel, sender_rank)
        raise
    return SendReport(nbytes, nbuckets, time.perf_counter() - t0)


register_backend("broadcast", BroadcastBackend)

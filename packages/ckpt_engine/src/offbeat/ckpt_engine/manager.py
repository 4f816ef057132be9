"""CheckpointEngineManager: one weight sync across a pool of replicas.

Runs abort -> release KV -> transfer -> resume KV -> resume on every replica concurrently,
each phase under a timeout, and reports which replicas got the new version and why the
others did not. Knows nothing about the engines behind the `SyncTarget`s nor about how
bytes travel (the backend does); it never imports Ray, vLLM or a trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from offbeat.ckpt_engine.bucket import ALIGN
from offbeat.ckpt_engine.errors import StaleVersionError
from offbeat.ckpt_engine.registry import Backend, SendReport, get_backend
from offbeat.ckpt_engine.target import SyncTarget

__all__ = ["DEFAULT_BUCKET_BYTES", "PHASES", "CheckpointEngineManager", "SyncResult"]

# The fallback when a backend names none; see the README's "Bucket size".
DEFAULT_BUCKET_BYTES = 256 << 20
PHASES = ("abort", "release_kv", "transfer", "resume_kv", "resume")

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass
class SyncResult:
    """The outcome of one sync. A replica in `failed` did not get `version`; it is left
    paused with its KV cache released, so it serves nothing half-updated."""

    version: int
    succeeded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    phase_s: dict[str, float] = field(default_factory=dict)
    # When each phase ran, in time.perf_counter() seconds (for a timeline): the pool's
    # window per phase, and each replica's own calls, replica -> [(phase, start, end)].
    phase_spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    replica_spans: dict[str, list[tuple[str, float, float]]] = field(default_factory=dict)
    bytes: int = 0
    buckets: int = 0

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def transfer_gbps(self) -> float:
        """Bytes streamed per second of the transfer phase, in GB/s (1e9 bytes)."""
        s = self.phase_s.get("transfer", 0.0)
        return self.bytes / s / 1e9 if s > 0 else 0.0


class CheckpointEngineManager:
    """Syncs weights from this process to a set of `SyncTarget` replicas.

    `release_kv=False` skips the KV-cache release and resume around the transfer.

    Replicas are registered with `add_target`/`remove_target` or passed per `sync` call
    (elastic pools). Backends that build process groups keep them across syncs while the
    set of replicas is unchanged.
    """

    def __init__(
        self,
        backend: str | Backend = "shm",
        *,
        bucket_bytes: int | None = None,
        phase_timeout_s: float = 300.0,
        transfer_timeout_s: float | None = None,
        wait_timeout_s: float | None = None,
        checksum: bool = False,
        backend_options: Mapping[str, Any] | None = None,
        targets: Mapping[str, SyncTarget] | None = None,
        release_kv: bool = True,
        health_probe: Callable[[SyncTarget], Awaitable[Any]] | None = None,
        health_poll_s: float = 2.0,
    ) -> None:
        if phase_timeout_s <= 0:
            raise ValueError(f"phase_timeout_s must be > 0, got {phase_timeout_s!r}")
        if not health_poll_s > 0:
            raise ValueError(f"health_poll_s must be > 0, got {health_poll_s!r}")
        if isinstance(backend, Backend):
            self._backend = backend
        else:
            self._backend = get_backend(backend)(**dict(backend_options or {}))
        if bucket_bytes is None:
            bucket_bytes = self._backend.default_bucket_bytes
        if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN or bucket_bytes % ALIGN:
            raise ValueError(
                f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes!r}"
            )
        self.bucket_bytes = bucket_bytes
        self.phase_timeout_s = phase_timeout_s
        self.transfer_timeout_s = transfer_timeout_s or phase_timeout_s
        # A receiver that makes no progress for this long (connect, one bucket) is dropped,
        # leaving the rest of the phase to the others.
        self.wait_timeout_s = wait_timeout_s or self.transfer_timeout_s / 2
        self.checksum = checksum
        # False: the replicas keep their KV cache through the transfer (the release_kv and
        # resume_kv phases are skipped). The release makes room for what a receiver
        # allocates while it loads (receive buffers, copies held until a layer is
        # complete); a receiver that copies straight into its parameters from buffers it
        # maps (cuda_ipc into a direct-copy vLLM worker) allocates nothing.
        self.release_kv = bool(release_kv)
        # While a transfer runs, each replica whose receiver has not finished is probed
        # every `health_poll_s`; one whose probe raises (its engine died: nothing will
        # ever connect) is dropped then, not after `wait_timeout_s`. A probe that does not
        # answer in time says nothing (a replica busy receiving may be slow to answer).
        self.health_probe = health_probe
        self.health_poll_s = float(health_poll_s)
        self._targets: dict[str, SyncTarget] = {}
        self._lock = asyncio.Lock()
        for name, t in (targets or {}).items():
            self.add_target(name, t)

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def targets(self) -> dict[str, SyncTarget]:
        return dict(self._targets)

    def add_target(self, name: str, target: SyncTarget) -> None:
        if name in self._targets:
            raise ValueError(f"replica {name!r} is already registered; remove it first")
        if not isinstance(target, SyncTarget):
            raise TypeError(
                f"replica {name!r} does not implement SyncTarget: {type(target).__name__}"
            )
        self._targets[name] = target

    def remove_target(self, name: str) -> SyncTarget:
        try:
            return self._targets.pop(name)
        except KeyError:
            raise KeyError(
                f"no replica named {name!r}; registered: {sorted(self._targets)}"
            ) from None

    def close(self) -> None:
        self._backend.close()

    async def sync(
        self,
        named_tensors: NamedTensors | Callable[[], NamedTensors],
        version: int,
        targets: Mapping[str, SyncTarget] | None = None,
    ) -> SyncResult:
        """Move `named_tensors` (an iterable of (HF name, tensor), or a factory of one) to
        every replica as weight `version`. Never raises for a replica's failure: it is
        reported in `SyncResult.failed`."""
        pool = dict(self._targets if targets is None else targets)
        async with self._lock:
            return await self._sync(named_tensors, version, pool)

    async def _sync(self, named_tensors, version: int, pool: dict[str, SyncTarget]) -> SyncResult:
        result = SyncResult(version)
        alive: list[str] = []
        for name in sorted(pool):
            try:
                held = pool[name].weight_version
            except Exception as e:
                result.failed[name] = f"weight_version: {type(e).__name__}: {e}"
                continue
            if held is not None and held > version:
                result.failed[name] = str(StaleVersionError(version, held))
            else:
                alive.append(name)

        async def timed(name: str, call, n: str) -> str | None:
            t0 = time.perf_counter()
            try:
                return await self._guard(name, call, pool[n])
            finally:
                result.replica_spans.setdefault(n, []).append((name, t0, time.perf_counter()))

        async def phase(name: str, call: Callable[[SyncTarget], Awaitable[Any]]) -> None:
            t0 = time.perf_counter()
            outcomes = await asyncio.gather(*(timed(name, call, n) for n in alive))
            for n, reason in zip(list(alive), outcomes, strict=True):
                if reason is not None:
                    result.failed[n] = reason
                    alive.remove(n)
            t1 = time.perf_counter()
            result.phase_s[name], result.phase_spans[name] = t1 - t0, (t0, t1)

        await phase("abort", lambda t: t.abort_all())
        if self.release_kv:
            await phase("release_kv", lambda t: t.release_kv_cache())
        t0 = time.perf_counter()
        if alive:
            report = await self._transfer(
                named_tensors, version, {n: pool[n] for n in alive}, result
            )
            result.bytes, result.buckets = report.bytes, report.buckets
            for n in [n for n in alive if n in result.failed]:
                alive.remove(n)
        t1 = time.perf_counter()
        result.phase_s["transfer"], result.phase_spans["transfer"] = t1 - t0, (t0, t1)
        if self.release_kv:
            await phase("resume_kv", lambda t: t.resume_kv_cache())
        await phase("resume", lambda t: t.resume())
        result.succeeded = list(alive)
        return result

    async def _guard(self, phase: str, call, target: SyncTarget) -> str | None:
        try:
            await asyncio.wait_for(call(target), self.phase_timeout_s)
        except TimeoutError:
            return f"{phase}: no answer within {self.phase_timeout_s:.1f}s"
        except Exception as e:
            return f"{phase}: {type(e).__name__}: {e}"
        return None

    async def _transfer(
        self, named_tensors, version: int, pool: dict[str, SyncTarget], result: SyncResult
    ) -> SendReport:
        names = list(pool)
        timeout = self.transfer_timeout_s
        # A replica of several engines (`sync_receivers` > 1, e.g. a prefill-decode one)
        # takes one rank per engine, and all of them in one `update_weights_ranks` call.
        ranks: dict[str, list[int]] = {}
        for name in names:
            first = sum(len(r) for r in ranks.values())
            ranks[name] = list(range(first, first + _receivers(pool[name])))
        owner = {r: name for name, rs in ranks.items() for r in rs}
        members = tuple(
            name if len(rs) == 1 else f"{name}/{i}"
            for name, rs in ranks.items()
            for i in range(len(rs))
        )
        sender = self._backend.open_sender(
            version=version,
            num_receivers=len(owner),
            bucket_bytes=self.bucket_bytes,
            checksum=self.checksum,
            timeout_s=self.wait_timeout_s,
            members=members,
        )
        if inspect.isawaitable(sender):  # a sender that lives in another process opens there
            sender = await sender
        stream = named_tensors() if callable(named_tensors) else named_tensors
        send_task = asyncio.ensure_future(asyncio.to_thread(sender.send, stream))
        reasons: dict[str, str] = {}
        received: set[str] = set()

        async def receive_one(name: str) -> None:
            t0 = time.perf_counter()
            own = ranks[name]
            try:
                if len(own) == 1:
                    got = await pool[name].update_weights(sender.spec(own[0]))
                else:
                    got = await pool[name].update_weights_ranks([sender.spec(r) for r in own])
                if got != version:
                    raise RuntimeError(
                        f"replica reported version {got} after a sync to version {version}"
                    )
                received.add(name)
            except Exception as e:
                reasons[name] = f"transfer: {type(e).__name__}: {e}"
                for rank in own:
                    sender.drop(rank, reasons[name])
            finally:
                span = ("transfer", t0, time.perf_counter())
                result.replica_spans.setdefault(name, []).append(span)

        recv_tasks = [asyncio.ensure_future(receive_one(n)) for n in names]
        task_of = dict(zip(names, recv_tasks, strict=True))

        async def watch() -> None:
            while True:
                waiting = [n for n in names if not task_of[n].done()]
                if not waiting:
                    return
                await asyncio.wait([task_of[n] for n in waiting], timeout=self.health_poll_s)
                waiting = [n for n in waiting if not task_of[n].done()]
                probe = self.health_probe
                assert probe is not None
                outcomes = await asyncio.gather(
                    *(asyncio.wait_for(probe(pool[n]), self.health_poll_s) for n in waiting),
                    return_exceptions=True,
                )
                for n, o in zip(waiting, outcomes, strict=True):
                    if isinstance(o, TimeoutError) or not isinstance(o, Exception):
                        continue
                    if task_of[n].done():
                        continue
                    reasons[n] = f"transfer: health check: {type(o).__name__}: {o}"
                    for rank in ranks[n]:
                        sender.drop(rank, reasons[n])
                    task_of[n].cancel()

        watcher = asyncio.ensure_future(watch()) if self.health_probe is not None else None
        try:
            deadline = time.monotonic() + timeout
            await asyncio.wait([send_task], timeout=timeout)
            if send_task.done() and not send_task.cancelled() and send_task.exception() is not None:
                err = send_task.exception()
                sender.abort(f"sender failed: {type(err).__name__}: {err}")  # unblock receivers
            if send_task.done() and not send_task.cancelled() and send_task.exception() is None:
                # Receivers the sender gave up on are failed already; stop waiting for them.
                for rank, why in send_task.result().failed.items():
                    task = task_of[owner[rank]]
                    if not task.done():
                        task.cancel()
                        reasons.setdefault(owner[rank], f"transfer: {why}")
            _done, pending = await asyncio.wait(
                [send_task, *recv_tasks], timeout=max(0.0, deadline - time.monotonic())
            )
            if pending:
                sender.abort(f"transfer did not finish within {timeout:.1f}s")
                for name, task in zip(names, recv_tasks, strict=True):
                    if not task.done():
                        task.cancel()
                        reasons.setdefault(name, f"transfer: no answer within {timeout:.1f}s")
                await asyncio.wait(recv_tasks, timeout=5.0)
                # The sender's waits end once aborted; give its thread a moment to unwind.
                await asyncio.wait([send_task], timeout=5.0)
            report = SendReport()
            if send_task.done() and not send_task.cancelled():
                if send_task.exception() is not None:
                    err = send_task.exception()
                    for name in names:  # the root cause, whatever the receivers saw
                        reasons[name] = f"transfer: sender failed: {type(err).__name__}: {err}"
                else:
                    report = send_task.result()
            for name in names:
                if name in received:
                    # The receiver saw the whole stream, end marker and bucket count included;
                    # trouble the sender had with other members does not undo that.
                    continue
                failed = [report.failed[r] for r in ranks[name] if r in report.failed]
                result.failed[name] = reasons.get(name) or (
                    f"transfer: {failed[0]}" if failed else "transfer: did not complete"
                )
            return report
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(BaseException):
                    await watcher


def _receivers(target: SyncTarget) -> int:
    """How many receivers `target` is in a sync: 1, or its `sync_receivers` (one per
    engine of a replica made of several, which then receives through
    `update_weights_ranks(specs)`)."""
    n = getattr(target, "sync_receivers", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"sync_receivers={n!r}: expected an int >= 1")
    return n

"""Admission of generate calls into the engine: FIFO, at most `limit` inside, none while closed.

A server lets at most `limit` requests into vLLM (its `max_num_seqs` plus a short queue),
and none while it is paused for a weight sync; the rest wait here, in arrival order. An
abort then touches only the requests inside the engine: the ones waiting here have
produced nothing, so instead of being aborted, answered, resent by their client and
re-admitted, they simply start after the pause, on the new weights.

Knows nothing about vLLM: plain asyncio, one event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["Admission", "Evicted"]


class Evicted(Exception):
    """A waiting call sent away by `Admission.evict()` (its server goes to sleep)."""


class Admission:
    """`await enter(k)` ... `leave(k)` around each request's time inside the engine; `k` is
    the request's weight (its sequences: `n` for a request of `n` samples).

    `limit=None`: no bound; a request heavier than `limit` goes in alone. `close()` stops admitting (requests inside stay inside until
    they leave); `reopen()` admits again, oldest waiter first.
    """

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"Admission limit must be >= 1 or None, got {limit!r}")
        self.limit = limit
        self.inside = 0
        self.is_open = True
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()
        self._empty = asyncio.Event()
        self._empty.set()

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f, _ in self._waiters)

    def _room(self, k: int) -> bool:
        return self.is_open and (
            self.limit is None or self.inside == 0 or self.inside + k <= self.limit
        )

    def _take(self, k: int) -> None:
        self.inside += k
        self._empty.clear()

    async def enter(self, k: int = 1) -> None:
        """Wait until this call (of weight `k`) may go into the engine (FIFO)."""
        if k < 1:
            raise ValueError(f"Admission weight must be >= 1, got {k!r}")
        if self._room(k) and not self._waiters:
            self._take(k)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((fut, k))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.leave(k)  # admitted, then cancelled before it could go in
            raise

    def leave(self, k: int = 1) -> None:
        """A request of weight `k` that entered is out of the engine."""
        self.inside -= k
        if self.inside == 0:
            self._empty.set()
        self._grant()

    def _grant(self) -> None:
        # FIFO: the oldest live waiter goes first; a heavier one blocks the lighter behind it.
        while self._waiters:
            fut, k = self._waiters[0]
            if fut.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if not self._room(k):
                return
            self._waiters.popleft()
            self._take(k)
            fut.set_result(None)

    def close(self) -> None:
        self.is_open = False

    def evict(self) -> int:
        """Send every waiting call away (`enter` raises `Evicted`); returns how many."""
        n = 0
        while self._waiters:
            fut, _ = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(Evicted())
                n += 1
        return n

    def reopen(self) -> None:
        self.is_open = True
        self._grant()

    async def wait_empty(self) -> None:
        """Until no request is inside."""
        await self._empty.wait()

"""Many `generate` calls, few Ray messages: the call path between a driver and a replica actor.

One Ray actor call per sample costs both processes CPU per call (argument and result
serialisation, task dispatch) and, worse, orders every call from one caller in one queue:
with hundreds of samples in flight a control call such as `abort_all()` waited behind
hundreds of `generate` calls to reach the actor, and its answer behind hundreds of results
to reach the driver (seconds, under CPU load). Here a driver-side `BatchedGenerateClient`
sends the calls of one event-loop tick as one `submit_generate` message, and the actor
sends finished results back on one long-lived stream (`generate_results`), whatever
finished since the last message in one message. Control calls keep their own messages and
find at most a few batches ahead of them.

A GRPO group (`generate_group(..., n)`) travels the same way: one call carrying `n`,
answered by the list of its `n` outputs.

Knows nothing about vLLM or Ray beyond a handle's `method.remote(...)` and an awaitable
(or async-iterable, for the stream) answer; `GenerateStream` (the actor side) only needs
`async generate(request_id, prompt_ids, sampling_params)` (and, for groups,
`async generate_group(request_id, prompt_ids, sampling_params, n)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pickle
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BatchedGenerateClient", "GenerateStream"]

# One call on the wire: (key, request_id, prompt_ids, sampling_params[, n]); with `n` it is
# a group (`generate_group`), without it one `generate`.
Call = tuple[Any, ...]
# One result on the wire: (key, ok, TokenOutput, a group's list of them, or the exception
# the call raised).
Result = tuple[int, bool, Any]


def _portable(e: BaseException) -> BaseException:
    """`e` if it pickles (it crosses a process boundary), else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
    return e


@dataclass
class _Outbox:
    """Results finished for one client and not yet sent, and that client's running calls."""

    items: list[Result] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: dict[int, asyncio.Task] = field(default_factory=dict)
    closed: bool = False


class GenerateStream:
    """The actor side: runs submitted calls through `generate` and queues their results
    per client until that client's stream takes them."""

    def __init__(
        self,
        generate: Callable[[str, list[int], Mapping[str, Any]], Awaitable[Any]],
        generate_group: Callable[[str, list[int], Mapping[str, Any], int], Awaitable[Any]]
        | None = None,
    ):
        self._generate = generate
        self._generate_group = generate_group
        self._boxes: dict[str, _Outbox] = {}

    def _box(self, client_id: str) -> _Outbox:
        box = self._boxes.get(client_id)
        if box is None:
            box = self._boxes[client_id] = _Outbox()
        return box

    def submit(self, client_id: str, calls: Sequence[Call]) -> None:
        """Start every call; returns at once (results come through `results`)."""
        box = self._box(client_id)
        for key, request_id, prompt_ids, params, *group in calls:
            n = group[0] if group else None
            box.tasks[key] = asyncio.ensure_future(
                self._run(box, key, request_id, prompt_ids, params, n)
            )

    async def _call(self, request_id: str, prompt_ids, params, n: int | None) -> Any:
        if n is None:
            return await self._generate(request_id, prompt_ids, params)
        if self._generate_group is None:
            raise TypeError(f"group call {request_id!r} (n={n}): this replica has no groups")
        return await self._generate_group(request_id, prompt_ids, params, n)

    async def _run(
        self, box: _Outbox, key: int, request_id: str, prompt_ids, params, n: int | None
    ) -> None:
        try:
            item: Result = (key, True, await self._call(request_id, prompt_ids, params, n))
        except asyncio.CancelledError:
            box.tasks.pop(key, None)  # cancelled by its client: nobody waits for it
            raise
        except Exception as e:
            item = (key, False, _portable(e))
        box.tasks.pop(key, None)
        box.items.append(item)
        box.ready.set()

    def cancel(self, client_id: str, keys: Sequence[int]) -> None:
        """Cancel calls whose caller gave up (the server aborts them in the engine)."""
        box = self._box(client_id)
        for key in keys:
            task = box.tasks.get(key)
            if task is not None:
                task.cancel()

    async def results(self, client_id: str):
        """Yield lists of the results finished since the previous yield, until the client
        is closed."""
        box = self._box(client_id)
        while not box.closed:
            await box.ready.wait()
            box.ready.clear()
            items, box.items = box.items, []
            if items and not box.closed:
                yield items

    def close(self, client_id: str) -> None:
        """Forget a client: cancel its running calls, drop its unsent results, end its
        stream."""
        box = self._boxes.pop(client_id, None)
        if box is not None:
            box.closed = True
            box.ready.set()
            for task in list(box.tasks.values()):
                task.cancel()

    @property
    def clients(self) -> int:
        return len(self._boxes)


class BatchedGenerateClient:
    """The driver side over an actor handle with `submit_generate(client_id, calls)`,
    `generate_results(client_id)` (a stream), `cancel_generate(client_id, keys)` and
    `close_generate(client_id)`: `await generate(...)` as if it were one call.

    The calls of one event-loop tick travel in one message. If the result stream fails
    (the actor died), every waiting call raises that error. Used from a new event loop
    (another `asyncio.run`), it starts over as a new client of the actor.
    """

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.client_id = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._keys = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._outgoing: list[Call] = []
        self._cancels: list[int] = []
        self._flush_scheduled = False
        self._stream: asyncio.Task | None = None
        self._sends: set[asyncio.Task] = set()

    @property
    def waiting(self) -> int:
        """Calls sent and not answered yet."""
        return len(self._waiting)

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start (over) as a new client on `loop`; the old loop's state is dead."""
        if self.client_id:
            self.handle.close_generate.remote(self.client_id)  # fire and forget
        self.client_id = uuid.uuid4().hex
        self._loop = loop
        self._waiting, self._outgoing, self._cancels = {}, [], []
        self._flush_scheduled = False
        self._sends = set()
        self._stream = loop.create_task(self._receive(self.client_id))

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any]
    ) -> Any:
        return await self._call((request_id, list(prompt_ids), dict(sampling_params)))

    async def generate_group(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        n: int,
    ) -> Any:
        """A group call: answered by the list of its `n` outputs."""
        return await self._call((request_id, list(prompt_ids), dict(sampling_params), n))

    async def _call(self, call: tuple[Any, ...]) -> Any:
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._stream is None or self._stream.done():
            self._bind(loop)
        key = next(self._keys)
        fut = loop.create_future()
        self._waiting[key] = fut
        self._outgoing.append((key, *call))
        self._schedule_flush(loop)
        try:
            return await fut
        except asyncio.CancelledError:
            if self._waiting.pop(key, None) is not None:
                self._cancels.append(key)
                self._schedule_flush(loop)
            raise

    def _schedule_flush(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        calls, self._outgoing = self._outgoing, []
        cancels, self._cancels = self._cancels, []
        if calls:
            self._send(self.handle.submit_generate.remote(self.client_id, calls), calls)
        if cancels:
            self._send(self.handle.cancel_generate.remote(self.client_id, cancels), [])

    def _send(self, ref: Any, calls: list[Call]) -> None:
        async def confirm() -> None:
            try:
                await ref
            except Exception as e:  # the actor is gone: these calls will never answer
                self._fail([c[0] for c in calls], e)

        task = asyncio.ensure_future(confirm())
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _receive(self, client_id: str) -> None:
        try:
            async for ref in self.handle.generate_results.remote(client_id):
                for key, ok, value in await ref:
                    fut = self._waiting.pop(key, None)
                    if fut is None or fut.done():
                        continue
                    if ok:
                        fut.set_result(value)
                    else:
                        fut.set_exception(value)
            raise RuntimeError("the replica closed the result stream")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if client_id == self.client_id:
                self._fail(list(self._waiting), e)

    def _fail(self, keys: list[int], error: BaseException) -> None:
        for key in keys:
            fut = self._waiting.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_exception(error)

    async def close(self) -> None:
        """End the stream and forget this client on the actor; waiting calls are
        cancelled."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)
        for fut in self._waiting.values():
            fut.cancel()
        self._waiting.clear()
        if self.client_id:
            with contextlib.suppress(Exception):
                await self.handle.close_generate.remote(self.client_id)
        self.client_id, self._loop = "", None

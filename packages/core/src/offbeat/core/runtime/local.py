"""A trainer rank in this process, behind a handle shaped like a Ray actor's.

`LocalRank(rank)` wraps a `TrainerRank` object so a `TrainerGroup` drives it exactly as
it drives rank actors: `handle.method.remote(*args)` starts the call at once on one of
the handle's own threads (as many as a rank actor's `max_concurrency`, so a sender's
`drop`/`abort` reaches it while `send_weights` runs) and returns a `LocalRef`, which any
event loop may await, or nobody (fire and forget, like an actor call). The call's
arguments and answer are the objects themselves: nothing is serialised or copied, so a
weight sync streams from the engine to the sender in this process as a bare engine's
would.

This is `runtime.trainer_in_driver`: rank 0 of a one-rank group, with no actor and no
pool bundle. Knows nothing about what the rank does; its threads take the accelerator
device their creator had (the one `split_gpus` gave the driver), where Ray would show a
rank actor only its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Any

__all__ = ["LocalRank", "LocalRef"]

# Calls one local rank runs at once: a rank actor's `max_concurrency` (TrainerGroup.start).
MAX_CONCURRENCY = 4


class LocalRef:
    """The answer of a call on a `LocalRank`, awaitable like a Ray ObjectRef (on any
    event loop, from any thread's loop); the call runs whether or not it is awaited."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    def __await__(self):
        return asyncio.wrap_future(self.future).__await__()


class _Method:
    def __init__(self, handle: LocalRank, name: str) -> None:
        self._handle, self._name = handle, name

    def remote(self, *args: Any, **kwargs: Any) -> LocalRef:
        return self._handle._submit(self._name, args, kwargs)


def _device_setter():
    """A thread initializer that makes the calling thread's accelerator device current
    on each of the handle's threads (None on CPU): torch keeps the current device per
    thread, and the driver chose its own (`offbeat.core.runtime.host.split_gpus`)."""
    import torch

    from offbeat.core.device import current_device

    kind = current_device().torch_type
    if kind == "cpu":
        return None
    module = torch.get_device_module(kind)
    if not module.is_initialized():
        # Nothing chose a device (`set_device` initialises the device's runtime): the
        # threads start where torch starts them, and a CPU job leaves it untouched.
        return None
    index = module.current_device()
    return lambda: module.set_device(index)


class LocalRank:
    """The handle of `rank` (a `TrainerRank`, or anything with its methods) running in
    this process. `rank`: the object itself, for a caller in this process that wants
    the engines after the group is done (tests, a job's summary)."""

    in_process = True  # the stall watchdog dumps this process's stacks itself

    def __init__(self, rank: Any, *, max_concurrency: int = MAX_CONCURRENCY) -> None:
        self.rank = rank
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_concurrency, thread_name_prefix=f"trainer-rank-{getattr(rank, 'rank', 0)}",
            initializer=_device_setter(),
        )  # fmt: skip

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_") or not callable(getattr(self.rank, name, None)):
            raise AttributeError(f"{type(self.rank).__name__} has no method {name!r}")
        return _Method(self, name)

    def _submit(self, name: str, args: tuple, kwargs: dict) -> LocalRef:
        try:
            return LocalRef(self._pool.submit(getattr(self.rank, name), *args, **kwargs))
        except RuntimeError as e:  # killed: the call fails when awaited, as an actor's would
            gone: concurrent.futures.Future = concurrent.futures.Future()
            gone.set_exception(RuntimeError(f"{self!r} was shut down; {name} not run ({e})"))
            return LocalRef(gone)

    def kill(self) -> None:
        """Take no new calls (`ray.kill` for an actor). A call under way runs to its end
        on its thread: a thread of this process cannot be stopped from outside, and the
        group has given up on its answer already."""
        with contextlib.suppress(Exception):
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return f"LocalRank({self.rank!r})"

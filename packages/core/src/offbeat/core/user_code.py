"""Calling user code (reward functions, tools) under a per-call deadline, off the event loop.

Knows nothing about rewards or tools: a callable, its arguments and a number of seconds.
An async function is awaited under `asyncio.wait_for` (and cancelled at the deadline). A
sync function runs in a daemon thread of its own, so a slow one never blocks the loop and
a hung one never holds a shared pool: Python cannot kill a thread, so at the deadline the
call is *abandoned* (its result, whenever it comes, is dropped; the thread is counted in
`abandoned_threads()` until it returns) and the caller gets `UserCodeTimeout` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["UserCodeTimeout", "abandoned_threads", "call_user_code"]

_abandoned_lock = threading.Lock()
_abandoned = 0  # threads past their deadline that have not returned yet


class UserCodeTimeout(TimeoutError):
    """A call of user code ran past its deadline (its thread, if any, is abandoned)."""


def abandoned_threads() -> int:
    """Threads of sync calls that ran past their deadline and still have not returned."""
    return _abandoned


def _settle(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


async def _in_thread(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)` in a new daemon thread; the result comes back on this loop."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()
    state = {"abandoned": False}
    lock = threading.Lock()

    def target() -> None:
        global _abandoned
        value, error = None, None
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller, whatever it is
            error = e
        with lock:
            if state["abandoned"]:
                with _abandoned_lock:
                    _abandoned -= 1
                return  # nobody waits for it any more
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(_settle, fut, value, error)

    threading.Thread(target=target, name=f"user-code:{_name(fn)}", daemon=True).start()
    try:
        return await fut
    except asyncio.CancelledError:
        global _abandoned
        with lock:
            if not state["abandoned"]:
                state["abandoned"] = True
                with _abandoned_lock:
                    _abandoned += 1
        raise


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


_limits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, asyncio.Semaphore]]
_limits = weakref.WeakKeyDictionary()


def _semaphore(key: int, size: int) -> asyncio.Semaphore:
    per_loop = _limits.setdefault(asyncio.get_running_loop(), {})
    if key not in per_loop:
        per_loop[key] = asyncio.Semaphore(size)
    return per_loop[key]


async def call_user_code(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout_s: float | None,
    limit: tuple[int, int] | None = None,
) -> Any:
    """`fn(*args, **kwargs)`, sync or async, within `timeout_s` seconds (None: no deadline);
    raises `UserCodeTimeout` past it and whatever `fn` raised otherwise. A sync function
    that returns an awaitable has it awaited within the same deadline.

    `limit=(key, n)`: at most `n` calls of that key run at once (the wait for a slot does
    not count against the deadline; an abandoned call gives its slot back)."""
    sem = _semaphore(*limit) if limit is not None else None
    if sem is not None:
        await sem.acquire()
    try:
        return await asyncio.wait_for(_call(fn, tuple(args), dict(kwargs or {})), timeout_s)
    except _OwnTimeout as e:  # `fn` raised TimeoutError itself: not the deadline
        raise e.error from None
    except TimeoutError as e:
        raise UserCodeTimeout(f"{_name(fn)} ran past its {timeout_s:g} s deadline") from e
    finally:
        if sem is not None:
            sem.release()


class _OwnTimeout(Exception):
    """Carries a TimeoutError that `fn` raised past `wait_for` (which raises its own)."""

    def __init__(self, error: TimeoutError) -> None:
        super().__init__(str(error))
        self.error = error


async def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    try:
        return await _call_unwrapped(fn, args, kwargs)
    except TimeoutError as e:
        raise _OwnTimeout(e) from None


async def _call_unwrapped(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (an object with an async __call__)
    ):
        return await fn(*args, **kwargs)
    value = await _in_thread(fn, args, kwargs)
    if inspect.isawaitable(value):
        value = await value
    return value

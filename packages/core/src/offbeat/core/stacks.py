"""Every thread's stack and every pending asyncio task's stack of this process, as text or
written to a file: what a hung process was doing (the stall watchdog writes it into the
run's log directory; the test session prints it when a test times out).

Safe to call from any thread, the event loop's included, while the loops run: the task
sets are read without their loops' help (a set that changes while read is read again).
Knows nothing about runs or tests.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

__all__ = ["dump_stacks", "format_stacks"]


def _tasks(loop: asyncio.AbstractEventLoop) -> set[asyncio.Task]:
    for _ in range(3):
        try:
            return asyncio.all_tasks(loop)
        except RuntimeError:  # the set changed under us: one more try
            continue
    return set()


def format_stacks() -> str:
    """Every thread's stack and every pending asyncio task's stack, as text. The garbage
    collector is off meanwhile: a pending task nothing else holds (only its loop's weak
    set does) would otherwise be collected by the allocations of the dump itself."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _format_stacks()
    finally:
        if enabled:
            gc.enable()


def _format_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in list(sys._current_frames().items()):
        out.append(f"--- thread {names.get(ident, '<unknown>')} ({ident})\n")
        out.append("".join(traceback.format_stack(frame)))
    with warnings.catch_warnings():  # isinstance on some lazy module objects warns
        warnings.simplefilter("ignore")
        loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]
    for loop in loops:
        if loop.is_closed():
            continue
        for task in list(_tasks(loop)):
            out.append(f"--- asyncio task {task.get_name()} on {type(loop).__name__}\n")
            for frame in task.get_stack():
                out.append("".join(traceback.format_stack(frame, limit=1)))
            coro = task.get_coro()
            out.append(f"    coroutine: {getattr(coro, '__qualname__', coro)}\n")
    return "".join(out)


def dump_stacks(directory: str | os.PathLike, prefix: str = "stacks", header: str = "") -> Path:
    """Write `header` and `format_stacks()` to a new file in `directory` (made if missing),
    named `<prefix>-<UTC time>-<pid>.txt`; returns its path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = d / f"{prefix}-{stamp}-{os.getpid()}.txt"
    text = (header.rstrip("\n") + "\n\n" if header else "") + format_stacks()
    path.write_text(text)
    return path

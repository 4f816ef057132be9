"""Every thread's stack and every pending asyncio task's stack of this process, as text or
written to a file: what a hung process was doing (the stall watchdog writes it into the
run's log directory; the test session prints it when a test times out).

Safe to call from any thread, the event loop's included, while the loops run: the task
sets are read without their loops' help (a set that changes while read is read again).
`actor_stacks` asks Ray actors for theirs (each runs `format_stacks` in its own process),
waiting a bounded time: a hung actor is named as not answering, never waited on.
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
from typing import Any

__all__ = [
    "DIAGNOSTICS_GROUPS",
    "STACKS_METHOD",
    "actor_stacks",
    "diagnostics_method",
    "dump_stacks",
    "format_actor_stacks",
    "format_stacks",
    "process_stacks",
]

# The actor method that answers `actor_stacks` (it returns `process_stacks()`).
STACKS_METHOD = "format_stacks"
# An async actor answers it on an event loop of its own, a Ray concurrency group: start
# the actor with `concurrency_groups=DIAGNOSTICS_GROUPS` and mark the method with
# `diagnostics_method`, and a coroutine that blocks the actor's main loop blocks not it.
DIAGNOSTICS_GROUPS = {"diagnostics": 1}


def diagnostics_method(method: Any) -> Any:
    """`method` in the diagnostics concurrency group (see `DIAGNOSTICS_GROUPS`)."""
    import ray

    return ray.method(concurrency_group="diagnostics")(method)


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


def process_stacks() -> str:
    """`format_stacks()` under a line naming this process (pid, command line)."""
    try:
        cmd = Path(f"/proc/{os.getpid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        cmd = " ".join(sys.argv)
    return f"pid {os.getpid()}: {cmd.strip()[:200]}\n" + format_stacks()


def actor_stacks(handles: dict[str, Any], timeout_s: float) -> dict[str, str]:
    """name -> the stacks of each Ray actor in `handles` (its `STACKS_METHOD`), or a line
    saying why not: it did not answer within `timeout_s` (all are asked at once), it
    raised, or it has no such method. Blocking: call it off the event loop (the stall
    watchdog calls it from its own thread)."""
    if not handles:
        return {}
    import ray

    out: dict[str, str] = {}
    refs: dict[Any, str] = {}
    for name, handle in handles.items():
        try:
            refs[getattr(handle, STACKS_METHOD).remote()] = name
        except Exception as e:  # no such method, or a handle that cannot submit
            out[name] = f"(no stacks: {type(e).__name__}: {e})"
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    for ref, name in refs.items():
        if ref not in ready:
            out[name] = f"(did not answer within {timeout_s:g} s)"
            continue
        try:
            out[name] = ray.get(ref, timeout=0)
        except Exception as e:  # the actor died, or its method raised
            out[name] = f"(no stacks: {type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return {name: out[name] for name in handles}


def format_actor_stacks(stacks: dict[str, str]) -> str:
    """`actor_stacks`' answer as text, one section per actor."""
    return "".join(f"\n=== actor {name}\n{text.rstrip()}\n" for name, text in stacks.items())


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

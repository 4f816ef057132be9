"""Processes forked from a preloaded server, started as `spawn` would start them.

A `multiprocessing` forkserver is a clean single-threaded process (safe to fork, unlike a
Ray worker with its gRPC threads) that can import heavy modules once, ahead of time, so
its children start with them imported. Its children would inherit the server's
environment, working directory and core mask, from when the server started;
`ForwardingProcess` gives each child the starting process's instead, read at `start()`,
and ties the child's life to the server's (which exits when the process that started it
does). Stdlib only: a child unpickles its target from here before anything else.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
from multiprocessing import forkserver, resource_tracker
from typing import Any

__all__ = ["ForkServerContext", "ForwardingProcess", "server_pid", "server_pids"]

_PR_SET_PDEATHSIG = 1


def server_pid() -> int | None:
    """This process's forkserver's pid (None when it runs none)."""
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def server_pids() -> list[int]:
    """The processes the forkserver's start left running: the server and multiprocessing's
    resource tracker (started first, beside it)."""
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    return [pid for pid in (server_pid(), tracker) if pid is not None]


def _die_with_parent() -> None:
    # Not Linux (no prctl): the server's own exit still ends the child's parent link.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _run(target: Any, env: dict[str, str], cpus: list[int], cwd: str, args: Any, kwargs: Any):
    # setproctitle (vLLM names its processes with it) claims the memory of argv and the
    # environment on first use, and fails once the environment has been rewritten.
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.getproctitle()
    os.environ.clear()
    os.environ.update(env)
    if cpus:
        os.sched_setaffinity(0, cpus)
    os.chdir(cwd)
    _die_with_parent()
    return target(*args, **kwargs)


_Base: Any = multiprocessing.get_context("forkserver").Process


class ForwardingProcess(_Base):
    """A forkserver process that runs its target in the starting process's environment,
    working directory and core mask, as `spawn` would, and ends when the server does."""

    def start(self) -> None:
        self._args = (
            self._target, dict(os.environ), sorted(os.sched_getaffinity(0)), os.getcwd(),
            self._args, self._kwargs,
        )  # fmt: skip
        self._target, self._kwargs = _run, {}
        super().start()


class ForkServerContext:
    """The forkserver context with `Process` replaced by `ForwardingProcess`."""

    Process = ForwardingProcess

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("forkserver")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

"""CPU cores for whole processes: the trainer/rollout resource split on a CPU machine.

Linux keeps an affinity mask per thread, and a new thread or process inherits the mask of
the thread that starts it. `pin_process(cpus)` therefore sets the mask of every thread the
process already has, so that everything it starts afterwards (threads, engine processes,
their workers) stays on `cpus` too. Knows nothing about which side a process belongs to:
the trainer pins itself through `offbeat.core.runtime.host.pin_trainer`, a rollout replica
through its engine package.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

__all__ = [
    "machine_cpus",
    "pin_process",
    "pin_threads",
    "process_tree_cpus",
    "share_of",
    "thread_cpus",
]

# The mask this process had before `pin_process` first narrowed it.
_before_pinning: frozenset[int] | None = None


def machine_cpus() -> list[int]:
    """The cores this process may be given (its mask before any `pin_process`)."""
    if _before_pinning is not None:
        return sorted(_before_pinning)
    return sorted(os.sched_getaffinity(0))


def _tids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only
        return [0]


def pin_process(cpus: Sequence[int]) -> None:
    """Confine every thread of this process (and so whatever it starts later) to `cpus`.

    Raises ValueError naming the cores that this machine does not let the process use.
    """
    global _before_pinning
    want = set(cpus)
    if not want:
        raise ValueError("pin_process: no cores given")
    usable = set(machine_cpus())
    if not want <= usable:
        raise ValueError(
            f"pin_process: cores {sorted(want - usable)} are not usable here; "
            f"usable cores: {sorted(usable)}"
        )
    if _before_pinning is None:
        _before_pinning = frozenset(os.sched_getaffinity(0))
    # Twice: a thread started while the first pass ran may have copied an old mask.
    for _ in range(2):
        for tid in _tids():
            with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
                os.sched_setaffinity(tid, want)


def pin_threads(pid: int, cpus: Sequence[int]) -> None:
    """Confine every thread of another process `pid` of ours (e.g. a helper it started
    before this one was pinned) to `cpus`; nothing when it is gone."""
    for _ in range(2):  # as in pin_process
        for tid in thread_cpus(pid):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, set(cpus))


def thread_cpus(pid: int) -> dict[int, set[int]]:
    """tid -> cores of every thread of process `pid` (empty if it is gone)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return {}
    out = {}
    for tid in tids:
        with contextlib.suppress(OSError):
            out[tid] = set(os.sched_getaffinity(tid))
    return out


def process_tree_cpus(pid: int) -> dict[int, tuple[str, set[int]]]:
    """pid -> (name, union of its threads' cores) for `pid` and all its descendants."""
    import psutil

    root = psutil.Process(pid)
    out: dict[int, tuple[str, set[int]]] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = proc.name()
        except psutil.Error:
            continue
        threads = thread_cpus(proc.pid)
        if threads:
            out[proc.pid] = (name, set().union(*threads.values()))
    return out


def share_of(cpus: Sequence[int], parts: int, index: int) -> list[int]:
    """Part `index` of `cpus` split into `parts` contiguous near-equal shares, or all of
    `cpus` when there are fewer cores than parts (the parts then share them)."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"share_of: index {index} of {parts} parts")
    cpus = list(cpus)
    if len(cpus) < parts:
        return cpus
    size, extra = divmod(len(cpus), parts)
    start = index * size + min(index, extra)
    return cpus[start : start + size + (index < extra)]

"""How busy a CPU replica keeps its cores: the CPU seconds of the processes pinned to them
(this process's descendants: the replica actor and its engine), sampled on a clock, over
the time the replica had requests in flight.

Knows nothing about the job or the trace's format: `CoreSampler` reads /proc (Linux;
elsewhere it samples nothing), `busy_fraction` is arithmetic on (time, CPU s) samples
and busy intervals on the same clock.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

__all__ = ["CoreSampler", "busy_fraction", "union"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _cpu_s(pid: int) -> float | None:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(f[11]) + int(f[12])) / _TICK  # utime + stime


class CoreSampler:
    """Samples, every `period` s on `clock`, the CPU seconds used so far by this
    process's descendants whose affinity lies within `cores` (a process that exits keeps
    what it used). `samples`: [(clock time, CPU s)]."""

    def __init__(self, cores: list[int], period: float = 0.5, clock=time.perf_counter) -> None:
        self.cores, self.period, self.clock = set(cores), period, clock
        self.samples: list[tuple[float, float]] = []
        self._used: dict[int, float] = {}  # pid -> CPU s; `found`: any process seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="core-sampler", daemon=True)

    def __enter__(self) -> CoreSampler:
        if self.cores and Path("/proc/self/stat").exists():
            self._thread.start()
        return self

    @property
    def found(self) -> bool:
        return bool(self._used)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def sample(self) -> None:
        kids, todo = _children(), [os.getpid()]
        while todo:
            for pid in kids.get(todo.pop(), []):
                todo.append(pid)
                try:
                    pinned = os.sched_getaffinity(pid) <= self.cores
                except OSError:
                    continue
                if pinned and (cpu := _cpu_s(pid)) is not None:
                    self._used[pid] = cpu
        self.samples.append((self.clock(), sum(self._used.values())))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def busy_fraction(
    samples: list[tuple[float, float]], busy: list[tuple[float, float]], cores: int
) -> float | None:
    """CPU seconds used while busy over busy seconds x `cores`: each sample interval's CPU
    counts by the share of it inside `busy` (disjoint intervals). None: no busy time."""
    cpu = seconds = 0.0
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        if t1 <= t0:
            continue
        inside = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in busy)
        cpu += (c1 - c0) * inside / (t1 - t0)
        seconds += inside
    if seconds <= 0 or cores < 1:
        return None
    return cpu / (seconds * cores)

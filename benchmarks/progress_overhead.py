"""What the stall watchdog's progress reports cost: one `progress.working(...)` block (an
operation in flight, then its success) and one `progress.advance(...)`, with a registry
active (a job's loop), against the same calls with none active (the hooks' no-op, the
baseline) and against an empty `with` block. Each the median of `--repeats` timings of
`--calls` calls on one thread, in nanoseconds per call; the load average is printed with
them. A job reports once per server call, reward call, finished or failed group, batch
taken, validation prompt, update and sync.

    python benchmarks/progress_overhead.py [--calls 200000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

from offbeat.core import progress
from offbeat.core.progress import Progress


def per_call_ns(fn, calls: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn(calls)
        runs.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(runs)


def working(calls: int) -> None:
    for _ in range(calls):
        with progress.working("generation", "rollout-0", "g1-0"):
            pass


def advance(calls: int) -> None:
    for _ in range(calls):
        progress.advance("buffer")


def empty_with(calls: int) -> None:
    null = contextlib.nullcontext()
    for _ in range(calls):
        with null:
            pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    rows = []
    for name, fn in (("working()", working), ("advance()", advance)):
        base = per_call_ns(fn, a.calls, a.repeats)  # no registry active: the no-op
        token = progress.activate(Progress())
        try:
            active = per_call_ns(fn, a.calls, a.repeats)
        finally:
            progress.deactivate(token)
        rows.append((name, active, base))
    empty = per_call_ns(empty_with, a.calls, a.repeats)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'hook':<12}{'registry active (ns/call)':>28}{'no registry (ns/call)':>24}")
    for name, active, base in rows:
        print(f"{name:<12}{active:>28.0f}{base:>24.0f}")
    print(f"{'empty with':<12}{empty:>28.0f}")


if __name__ == "__main__":
    main()

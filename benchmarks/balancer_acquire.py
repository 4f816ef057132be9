"""Figure 1: in-process acquire+release per pair, offbeat's LoadBalancer vs an O(N) scan.

The baseline is the common design (verl's GlobalRequestLoadBalancer works this way): a dict of
in-flight counts under a lock, a sticky LRU by request id, and `min()` over every server on
each acquire. Both sides get unique request ids (so every acquire routes and the sticky map
churns at capacity) and the same two loads: "idle" (release right after acquire) and
"busy" (4 open leases per server; each step releases the oldest and acquires a new one).

    python benchmarks/balancer_acquire.py [--pairs 200000] [--repeats 5]
Prints microseconds per acquire+release pair (best of the repeats) for 16 and 1,024 servers.
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
import time

from offbeat.balancer import LoadBalancer


class ScanBalancer:
    """Least in-flight by scanning every server (the baseline)."""

    def __init__(self, servers, sticky_capacity=10_000):
        self._lock = threading.Lock()
        self._inflight = dict.fromkeys(servers, 0)
        self._sticky: collections.OrderedDict = collections.OrderedDict()
        self._cap = sticky_capacity

    def acquire(self, request_id):
        with self._lock:
            sid = self._sticky.get(request_id)
            if sid is None or sid not in self._inflight:
                sid = min(self._inflight, key=self._inflight.__getitem__)
                self._sticky[request_id] = sid
                if len(self._sticky) > self._cap:
                    self._sticky.popitem(last=False)
            else:
                self._sticky.move_to_end(request_id)
            self._inflight[sid] += 1
            return sid

    def release(self, sid):
        with self._lock:
            if self._inflight.get(sid, 0) > 0:
                self._inflight[sid] -= 1


def clocks():
    return time.thread_time(), time.perf_counter()


def run_idle(acquire, release, ids):
    c0, w0 = clocks()
    for rid in ids:
        release(acquire(rid))
    c1, w1 = clocks()
    return c1 - c0, w1 - w0


def run_busy(acquire, release, ids, window):
    held = collections.deque(acquire(f"warm-{i}") for i in range(window))
    pop, push = held.popleft, held.append
    c0, w0 = clocks()
    for rid in ids:
        release(pop())
        push(acquire(rid))
    c1, w1 = clocks()
    for lease in held:
        release(lease)
    return c1 - c0, w1 - w0


def measure(make, n_servers, pairs, repeats, mode):
    """Best of `repeats`: (CPU µs/pair of this thread, wall µs/pair)."""
    cpu = wall = float("inf")
    for r in range(repeats):
        lb = make([f"s{i}" for i in range(n_servers)])
        ids = [f"r{r}-{i}" for i in range(pairs)]
        if mode == "idle":
            c, w = run_idle(lb.acquire, lb.release, ids)
        else:
            c, w = run_busy(lb.acquire, lb.release, ids, window=4 * n_servers)
        cpu, wall = min(cpu, c), min(wall, w)
    return cpu / pairs * 1e6, wall / pairs * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--servers", type=int, nargs="+", default=[16, 1024])
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    print("µs per acquire+release pair, best of repeats; CPU = this thread's CPU time")
    print("(robust to other processes on the machine), wall = elapsed time")
    head = f"{'servers':>8} {'load':>5} | {'offbeat CPU':>11} {'wall':>6} | {'O(N) scan CPU':>13} {'wall':>6} | {'speedup':>7}"
    print(head)
    print("-" * len(head))
    for n in args.servers:
        for mode in ("idle", "busy"):
            oc, ow = measure(LoadBalancer, n, args.pairs, args.repeats, mode)
            bc, bw = measure(ScanBalancer, n, args.pairs, args.repeats, mode)
            print(
                f"{n:>8} {mode:>5} | {oc:>11.2f} {ow:>6.2f} | {bc:>13.2f} {bw:>6.2f} | {bc / oc:>6.1f}x"
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

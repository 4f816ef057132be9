"""Figure 2: routing through a Ray actor across processes, offbeat's wrapper vs a naive actor.

offbeat: `make_balancer_actor` (the LoadBalancer core in a Ray actor) with `acquire_many` /
`release_many`, so a client routes a whole GRPO group per call. Baseline: the usual naive
actor, one Ray call per request (acquire, later release), least in-flight by a scan.
Both run as real actors in a local Ray (separate worker processes) with the same 16 servers.

    python benchmarks/balancer_ray.py [--requests 20000] [--group 64] [--latency-calls 2000]
Prints routing decisions per second (acquire + release of every request, pipelined from one
client) and the p50 / p99 latency of one sequential acquire call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time


class NaiveBalancerActor:
    """The baseline: one call per request, least in-flight by scanning every server."""

    def __init__(self, servers):
        self._lock = threading.Lock()
        self._inflight = dict.fromkeys(servers, 0)

    def acquire(self, request_id):
        with self._lock:
            sid = min(self._inflight, key=self._inflight.__getitem__)
            self._inflight[sid] += 1
            return sid

    def release(self, server_id):
        with self._lock:
            if self._inflight.get(server_id, 0) > 0:
                self._inflight[server_id] -= 1


def start_ray(ray) -> None:
    from ray._private import ray_constants

    # Under `uv run`, Ray would package the working tree and start workers through uv again.
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


def batched_throughput(ray, actor, n, group, in_flight_calls=16):
    """offbeat: acquire_many of `group` ids per call, `in_flight_calls` calls pipelined."""
    ids = [f"b{i}" for i in range(n)]
    chunks = [ids[i : i + group] for i in range(0, n, group)]
    t0 = time.perf_counter()
    pending, releases = [], []
    for chunk in chunks:
        pending.append(actor.acquire_many.remote(chunk))
        if len(pending) >= in_flight_calls:
            releases.append(actor.release_many.remote(ray.get(pending.pop(0))))
    for ref in pending:
        releases.append(actor.release_many.remote(ray.get(ref)))
    released = sum(sum(r) for r in ray.get(releases))
    dt = time.perf_counter() - t0
    assert released == n, released
    return n / dt


def per_request_throughput(ray, actor, n, release_arg, in_flight_calls=256):
    """One acquire call and one release call per request, pipelined."""
    t0 = time.perf_counter()
    pending, releases = [], []
    for i in range(n):
        pending.append(actor.acquire.remote(f"p{i}"))
        if len(pending) >= in_flight_calls:
            releases.append(actor.release.remote(release_arg(ray.get(pending.pop(0)))))
    for ref in pending:
        releases.append(actor.release.remote(release_arg(ray.get(ref))))
    ray.get(releases)
    return n / (time.perf_counter() - t0)


def single_latency(ray, actor, n, release_many):
    """Sequential single acquires: each waits for its answer. Leases released afterwards."""
    lat, leases = [], []
    for i in range(n):
        t0 = time.perf_counter()
        leases.append(ray.get(actor.acquire.remote(f"l{i}")))
        lat.append(time.perf_counter() - t0)
    release_many(leases)
    lat.sort()
    return statistics.median(lat) * 1e3, lat[int(0.99 * (len(lat) - 1))] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--group", type=int, default=64, help="request ids per acquire_many call")
    ap.add_argument("--latency-calls", type=int, default=2_000)
    ap.add_argument("--servers", type=int, default=16)
    args = ap.parse_args()

    import ray

    from offbeat.balancer.actor import make_balancer_actor

    start_ray(ray)
    servers = [f"s{i}" for i in range(args.servers)]
    ours = make_balancer_actor(servers, sticky_capacity=0)
    naive = ray.remote(NaiveBalancerActor).options(num_cpus=0).remote(servers)
    ray.get([ours.servers.remote(), naive.acquire.remote("warm")])
    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")

    n = args.requests
    rows = []
    ours_batched = batched_throughput(ray, ours, n, args.group)
    ours_single = per_request_throughput(ray, ours, n // 4, lambda lease: lease.lease_id)
    naive_single = per_request_throughput(ray, naive, n // 4, lambda sid: sid)
    rows.append(("decisions/s, batched acquire_many", f"{ours_batched:,.0f}", "-"))
    rows.append(
        ("decisions/s, one call per request", f"{ours_single:,.0f}", f"{naive_single:,.0f}")
    )

    def release_ours(leases):
        ray.get(ours.release_many.remote(leases))

    def release_naive(sids):
        ray.get([naive.release.remote(s) for s in sids])

    o50, o99 = single_latency(ray, ours, args.latency_calls, release_ours)
    n50, n99 = single_latency(ray, naive, args.latency_calls, release_naive)
    rows.append(("single acquire latency p50 (ms)", f"{o50:.3f}", f"{n50:.3f}"))
    rows.append(("single acquire latency p99 (ms)", f"{o99:.3f}", f"{n99:.3f}"))

    status = ray.get(ours.status.remote())
    assert status["total_inflight"] == 0 and status["open_leases"] == 0, status

    print(f"{args.servers} servers, {n:,} requests, acquire_many groups of {args.group}")
    w = max(len(r[0]) for r in rows)
    print(f"{'':<{w}} | {'offbeat actor':>14} | {'naive actor':>12}")
    print("-" * (w + 33))
    for name, a, b in rows:
        print(f"{name:<{w}} | {a:>14} | {b:>12}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()

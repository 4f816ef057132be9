"""Threaded stress: many threads acquire and release while membership and health churn."""

import contextlib
import random
import threading

from offbeat.balancer import LoadBalancer, NoServerAvailable

IDS = [f"s{i}" for i in range(6)]


def test_concurrent_acquire_release_keeps_every_invariant():
    lb = LoadBalancer(IDS, policy="least_inflight", sticky_capacity=64, seed=0)
    stop = threading.Event()
    errors: list[BaseException] = []
    leases_per_thread: list[list] = []

    def worker(seed):
        rng = random.Random(seed)
        held, done = [], []
        leases_per_thread.append(done)
        try:
            for i in range(3000):
                if held and rng.random() < 0.5:
                    lease = held.pop(rng.randrange(len(held)))
                    lb.release(lease)
                    done.append(lease)
                else:
                    with contextlib.suppress(NoServerAvailable):
                        rid = f"{seed}-{rng.randrange(50)}"
                        held.append(lb.acquire(rid, cost=rng.randint(1, 3)))
                if i % 200 == 0:
                    counts = lb.status()["servers"].values()
                    assert all(c >= 0 for c in counts)
            for lease in held:
                lb.release(lease)
                done.append(lease)
        except BaseException as e:  # surfaced below
            errors.append(e)

    def churn():
        rng = random.Random(99)
        while not stop.is_set():
            sid = rng.choice(IDS)
            op = rng.randrange(4)
            if op == 0:
                lb.remove_servers([sid], drain=rng.random() < 0.5)
            elif op == 1:
                lb.add_servers([sid])
            elif op == 2:
                lb.mark_unhealthy(sid)
            else:
                lb.mark_healthy(sid)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    churner = threading.Thread(target=churn)
    churner.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    churner.join()
    assert not errors, errors
    status = lb.status()
    assert status["total_inflight"] == 0
    assert all(c == 0 for c in status["servers"].values())
    assert status["draining"] == []  # a drained server is dropped once its count hits 0
    assert all(lease.released for done in leases_per_thread for lease in done)


def test_a_lease_released_from_many_threads_counts_once():
    lb = LoadBalancer(["a"])
    for _ in range(50):
        lease = lb.acquire("r")
        results = []
        barrier = threading.Barrier(4)

        def rel(lease=lease, results=results, barrier=barrier):
            barrier.wait()
            results.append(lb.release(lease))

        ts = [threading.Thread(target=rel) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert sorted(results) == [False, False, False, True]
        assert lb.inflight("a") == 0

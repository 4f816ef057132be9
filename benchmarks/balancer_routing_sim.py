"""Figure 3: routing quality of each policy in a seeded simulation of 8 LLM replicas.

The workload mixes GRPO groups (n samples sharing one prompt, one `group_id`) and multi-turn
sessions (each turn's prompt extends the last turn's prompt + response; the session id is the
request id, so every policy keeps sessions sticky), with long-tailed (log-normal) response
lengths and one replica drained mid-run, restarted (empty cache) and added back.

Each replica is simulated with continuous batching: a step admits waiting requests (prefill
costs time per *uncached* prompt token), then every running sequence decodes one token; a
step takes c0 + c1 * running + c2 * prefill tokens. Each replica's prefix cache is an LRU of
block hashes with a finite capacity; a prompt hits the longest run of its leading blocks
found there. The balancer sees only what a real one sees: acquire on arrival, release on
completion. The baseline is `least_inflight`, the default of every balancer compared here.

    python benchmarks/balancer_routing_sim.py [--seeds 0 1 2]
Prints, per policy (mean over seeds): prefix-cache hit rate (cached / all prompt tokens),
load imbalance (time-averaged coefficient of variation of in-flight across active replicas),
and makespan (simulated seconds until the last request completes).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from offbeat.balancer import LoadBalancer, block_hashes

BLOCK = 16


@dataclass
class Config:
    replicas: int = 8
    groups: int = 128  # GRPO prompts
    group_size: int = 8  # samples per prompt
    sessions: int = 48
    turns: int = 4
    system_tokens: int = 32  # shared by every prompt
    question_tokens: tuple[int, int] = (96, 768)
    user_turn_tokens: tuple[int, int] = (32, 160)
    response_median: float = 180.0  # log-normal: median, sigma; capped
    response_sigma: float = 1.0
    response_cap: int = 2048
    arrival_window: float = 12.0  # groups and sessions start within [0, window] s
    think_time: tuple[float, float] = (0.2, 1.0)  # between a session's turns
    max_batch: int = 48  # running sequences per replica
    cache_blocks: int = 3000  # per replica (48k tokens)
    c0: float = 0.012  # s per step
    c1: float = 0.0002  # s per running sequence per step
    c2: float = 0.00012  # s per prefilled (uncached) token
    remove_at: float = 6.0  # drain replica 3 ...
    readd_at: float = 14.0  # ... and add it back (restarted, empty cache)
    sample_every: float = 0.05


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    response: list[int]
    group_id: str | None = None
    session: int | None = None
    turn: int = 0


@dataclass
class Replica:
    name: str
    cache: OrderedDict = field(default_factory=OrderedDict)
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)  # [request, lease, tokens left]
    stepping: bool = False

    def cached_prefix_blocks(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def touch(self, hashes: list[int], capacity: int) -> None:
        cache = self.cache
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32_000) for _ in range(n)]


def response_len(rng: random.Random, cfg: Config) -> int:
    n = int(rng.lognormvariate(math.log(cfg.response_median), cfg.response_sigma))
    return max(1, min(cfg.response_cap, n))


def workload(cfg: Config, seed: int):
    """(arrival time, Request) for groups and first turns; later turns come from completions."""
    rng = random.Random(seed)
    system = tokens(rng, cfg.system_tokens)
    arrivals = []
    for g in range(cfg.groups):
        t = rng.uniform(0, cfg.arrival_window)
        prompt = system + tokens(rng, rng.randint(*cfg.question_tokens))
        for i in range(cfg.group_size):
            resp = tokens(rng, response_len(rng, cfg))
            arrivals.append((t, Request(f"g{g}-{i}", prompt, resp, group_id=f"g{g}")))
    later_turns = {}  # session -> [(think time, user tokens, response)] for turns 1..
    for s in range(cfg.sessions):
        t = rng.uniform(0, cfg.arrival_window)
        prompt = system + tokens(rng, rng.randint(*cfg.question_tokens))
        arrivals.append(
            (t, Request(f"sess{s}", prompt, tokens(rng, response_len(rng, cfg)), session=s))
        )
        later_turns[s] = [
            (
                rng.uniform(*cfg.think_time),
                tokens(rng, rng.randint(*cfg.user_turn_tokens)),
                tokens(rng, response_len(rng, cfg)),
            )
            for _ in range(cfg.turns - 1)
        ]
    return arrivals, later_turns


def simulate(policy: str, cfg: Config, seed: int) -> dict[str, float]:
    arrivals, later_turns = workload(cfg, seed)  # the same requests for every policy
    names = [f"r{i}" for i in range(cfg.replicas)]
    replicas = {n: Replica(n) for n in names}
    lb = LoadBalancer(names, policy=policy, seed=seed)
    events: list = []
    seq = 0

    def push(t, kind, payload):
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    for t, req in arrivals:
        push(t, "arrive", req)
    victim = names[3]
    push(cfg.remove_at, "remove", victim)
    push(cfg.readd_at, "readd", victim)

    prompt_tokens = cached_tokens = 0
    cv_samples: list[float] = []
    next_sample = 0.0
    done = 0
    total = cfg.groups * cfg.group_size + cfg.sessions * cfg.turns
    makespan = 0.0
    drained_restart_pending = False

    while events:
        now, _, kind, payload = heapq.heappop(events)
        while next_sample <= now:  # load imbalance over active replicas
            loads = [lb.inflight(n) for n in lb.servers()]
            mean = statistics.fmean(loads) if loads else 0.0
            if mean > 0:
                cv_samples.append(statistics.pstdev(loads) / mean)
            next_sample += cfg.sample_every
        if kind == "arrive":
            req = payload
            lease = lb.acquire(req.request_id, group_id=req.group_id, prompt_ids=req.prompt)
            rep = replicas[lease.server_id]
            rep.waiting.append((req, lease))
            if not rep.stepping:
                rep.stepping = True
                push(now, "step", rep)
        elif kind == "remove":
            lb.remove_servers([payload], drain=True)
            drained_restart_pending = True
        elif kind == "readd":
            if drained_restart_pending and payload not in lb.status()["servers"]:
                replicas[payload].cache.clear()  # drained and restarted: the cache is gone
            drained_restart_pending = False
            lb.add_servers([payload])
        else:  # "step": finish the running step, then start the next
            rep = payload
            still = []
            for entry in rep.running:
                entry[2] -= 1
                if entry[2] > 0:
                    still.append(entry)
                    continue
                req, lease = entry[0], entry[1]
                lb.release(lease)
                rep.touch(block_hashes(req.prompt + req.response, BLOCK), cfg.cache_blocks)
                done += 1
                makespan = now
                if req.session is not None and req.turn + 1 < cfg.turns:
                    think, user, response = later_turns[req.session][req.turn]
                    nxt = Request(
                        req.request_id,
                        req.prompt + req.response + user,
                        response,
                        session=req.session,
                        turn=req.turn + 1,
                    )
                    push(now + think, "arrive", nxt)
            rep.running = still
            prefill = 0
            while rep.waiting and len(rep.running) < cfg.max_batch:
                req, lease = rep.waiting.popleft()
                hashes = block_hashes(req.prompt, BLOCK)
                hit = rep.cached_prefix_blocks(hashes) * BLOCK
                prompt_tokens += len(req.prompt)
                cached_tokens += hit
                prefill += len(req.prompt) - hit
                rep.touch(hashes, cfg.cache_blocks)
                rep.running.append([req, lease, len(req.response)])
            if not rep.running:
                rep.stepping = False
                continue
            push(now + cfg.c0 + cfg.c1 * len(rep.running) + cfg.c2 * prefill, "step", rep)

    assert done == total, (done, total)
    assert lb.status()["total_inflight"] == 0
    return {
        "hit_rate": cached_tokens / prompt_tokens,
        "imbalance_cv": statistics.fmean(cv_samples),
        "makespan": makespan,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    cfg = Config()
    policies = ["least_inflight", "round_robin", "power_of_two", "prefix"]
    results = {p: [simulate(p, cfg, s) for s in args.seeds] for p in policies}
    mean = {p: {k: statistics.fmean(r[k] for r in rs) for k in rs[0]} for p, rs in results.items()}
    base = mean["least_inflight"]
    print(
        f"{cfg.replicas} replicas; {cfg.groups} GRPO groups x {cfg.group_size}, {cfg.sessions} "
        f"sessions x {cfg.turns} turns; log-normal responses (median {cfg.response_median:.0f}, "
        f"cap {cfg.response_cap}); replica r3 drained at {cfg.remove_at}s, restarted and re-added "
        f"at {cfg.readd_at}s; seeds {args.seeds} (mean)"
    )
    head = (
        f"{'policy':<16} {'hit rate':>9} {'vs base':>8} {'imbalance CV':>13} "
        f"{'makespan s':>11} {'vs base':>8}"
    )
    print(head)
    print("-" * len(head))
    for p in policies:
        m = mean[p]
        tag = " (baseline)" if p == "least_inflight" else ""
        print(
            f"{p:<16} {m['hit_rate']:>9.3f} {m['hit_rate'] / base['hit_rate']:>7.2f}x "
            f"{m['imbalance_cv']:>13.3f} {m['makespan']:>11.2f} "
            f"{m['makespan'] / base['makespan'] - 1:>+7.1%}{tag}"
        )
    for s, (pr, li) in enumerate(zip(results["prefix"], results["least_inflight"], strict=True)):
        print(
            f"seed {args.seeds[s]}: prefix hit {pr['hit_rate']:.3f} vs {li['hit_rate']:.3f} "
            f"({pr['hit_rate'] / li['hit_rate']:.2f}x), makespan {pr['makespan']:.2f} vs "
            f"{li['makespan']:.2f} s ({pr['makespan'] / li['makespan'] - 1:+.1%})"
        )


if __name__ == "__main__":
    main()

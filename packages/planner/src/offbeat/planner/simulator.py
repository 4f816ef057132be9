"""A discrete-event simulator of one offbeat job: sync, separate_async, hybrid validation.

It replays the trainer loop of `offbeat.core.trainer.trainer` on a clock instead of
engines: the rollout driver keeps `max_concurrent_groups` prompt groups of `n` samples
in flight on `replicas` replicas (the balancer sends a group to the least-loaded one);
each replica decodes its requests by processor sharing at the profile's tokens/s for
that many in flight (requests past `max_num_seqs` queue; replicas that share a device
time-slice it); each sample's length is drawn
from the profile's response lengths. The trainer waits for its batch, trains
`parameter_sync_step` mini-batches, then syncs: every replica pauses for the sync (the
in-flight requests are aborted and resume afterwards with what they had: partial
rollout), and the version moves on. Validation runs in the background on the replicas,
or, hybrid, as a cycle the trainer waits for with extra replicas on its devices.

The staleness rules are not re-implemented: admission, `drop` evictions, `wait` blocking
and oldest-first batches come from the real `offbeat.core.buffer.ReplayBuffer`.

Knows nothing about real engines, configs or files: a `SimConfig` and a `Profile` in, a
`SimResult` out. Deterministic for a seed. Metrics are defined as the trainer defines
them (`timing/step_s`, `perf/trainer_idle_frac`, `perf/rollout_idle_frac`,
`perf/tokens_per_s`), so predictions and runs compare like for like.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from offbeat.core.buffer import BufferConfig, ReplayBuffer
from offbeat.planner.profile import Profile

__all__ = ["MODES", "SimConfig", "SimResult", "StepRecord", "simulate"]

MODES = ("sync", "separate_async")
_EPS = 1e-9


@dataclass
class SimConfig:
    """The job's knobs the pipeline's timing depends on (names as in the job config)."""

    mode: str = "separate_async"
    steps: int = 10
    train_batch_size: int = 32  # prompt groups per global step
    n: int = 8
    ppo_mini_batch_size: int = 16
    parameter_sync_step: int = 2
    ppo_epochs: int = 1
    max_off_policy_threshold: int = 2
    max_off_policy_strategy: str = "drop"
    num_warmup_batches: int = 1
    trainer_devices: int = 1
    replicas: int = 1
    tp: int = 1
    max_concurrent_groups: int = 64
    prompt_len: float = 8.0
    max_tokens: int = 256
    test_freq: int = 0
    val_before_train: bool = False
    hybrid: bool = False  # trainer.validate_on_trainer_devices
    old_log_prob_source: str = "rollout"
    seed: int = 0
    skip_steps: int = 1  # first steps left out of the averages (the pipeline fills)
    # How the trainer lays out a batch: "pad" to its longest response (offbeat's FSDP2
    # engine, TrajectoryBatch.pad) or "packed" (sequence packing: each row its own length).
    layout: str = "pad"
    # The device (cores, GPUs) each replica decodes on: replicas with the same id share it
    # (CPU replicas given the same runtime.rollout_cpus) and time-slice it (see `_rate`).
    # Empty: every replica has devices of its own.
    replica_devices: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"trainer.mode={self.mode!r}: expected one of {MODES}")
        for key in ("steps", "train_batch_size", "n", "ppo_mini_batch_size", "replicas", "tp"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{key}={v!r}: must be an int >= 1")
        if self.layout not in ("pad", "packed"):
            raise ValueError(f"layout={self.layout!r}: expected 'pad' or 'packed'")
        if self.replica_devices and len(self.replica_devices) != self.replicas:
            raise ValueError(
                f"replica_devices={self.replica_devices!r}: one device id per replica "
                f"(replicas={self.replicas})"
            )
        if self.train_batch_size != self.parameter_sync_step * self.ppo_mini_batch_size:
            raise ValueError(
                f"train_batch_size={self.train_batch_size} must equal parameter_sync_step="
                f"{self.parameter_sync_step} x ppo_mini_batch_size={self.ppo_mini_batch_size}"
            )

    def buffer_config(self) -> BufferConfig:
        return BufferConfig(
            groups_per_step=self.train_batch_size,
            max_off_policy_threshold=self.max_off_policy_threshold,
            max_off_policy_strategy=self.max_off_policy_strategy,
            num_warmup_batches=0 if self.mode == "sync" else self.num_warmup_batches,
        )


@dataclass
class StepRecord:
    step: int
    step_s: float
    wait_s: float
    train_s: float
    sync_s: float
    val_s: float
    busy_s: float  # rollout: at least one group in flight and not paused
    tokens: int  # tokens of the groups finished during the step
    evicted: int

    @property
    def trainer_idle(self) -> float:
        return self.wait_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def rollout_idle(self) -> float:
        return max(0.0, 1.0 - self.busy_s / self.step_s) if self.step_s > 0 else 0.0


@dataclass
class SimResult:
    config: SimConfig
    steps: list[StepRecord]
    staleness: Counter  # trained trajectories by (policy version - min weight version)
    spans: Counter  # trained trajectories by their group's span
    evicted_spans: Counter  # evicted groups by span at eviction
    counts: dict[str, int]
    total_s: float

    def _window(self) -> list[StepRecord]:
        skip = min(self.config.skip_steps, len(self.steps) - 1)
        return self.steps[skip:]

    @property
    def step_s(self) -> float:
        w = self._window()
        return sum(r.step_s for r in w) / len(w)

    @property
    def trainer_idle(self) -> float:
        w = self._window()
        return sum(r.trainer_idle for r in w) / len(w)

    @property
    def rollout_idle(self) -> float:
        w = self._window()
        return sum(r.rollout_idle for r in w) / len(w)

    @property
    def tokens_per_s(self) -> float:
        w = self._window()
        return sum(r.tokens for r in w) / max(_EPS, sum(r.step_s for r in w))

    @property
    def evictions(self) -> int:
        return self.counts["evicted"]

    def summary(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "trainer_idle": self.trainer_idle,
            "rollout_idle": self.rollout_idle,
            "tokens_per_s": self.tokens_per_s,
            "evictions": self.evictions,
            "staleness": dict(sorted(self.staleness.items())),
            "spans": dict(sorted(self.spans.items())),
        }

    def predict_line(self) -> str:
        return (
            f"predicted: step_s={self.step_s:.4f} trainer_idle={self.trainer_idle:.4f} "
            f"rollout_idle={self.rollout_idle:.4f} tokens_per_s={self.tokens_per_s:.2f}"
        )


# ---- the moving parts -------------------------------------------------------------------
@dataclass
class _Group:
    uid: str
    started_version: int
    left: int
    tokens: int = 0
    longest: int = 0


@dataclass
class _Replica:
    """Processor sharing on a virtual clock: `served` is the tokens every active request
    has received since start; a request ends when it reaches its finish mark."""

    max_num_seqs: int
    device: int | None = None  # replicas with the same id share one device; None: its own
    served: float = 0.0
    heap: list[tuple[float, int, Any]] = field(default_factory=list)
    queue: deque = field(default_factory=deque)
    # Sequences of the calls in flight on it: a group's call holds all n of its samples
    # until its last one ends (the balancer's lease, the trace's "in flight" count, which
    # the profile's tokens/s curve is measured against).
    outstanding: int = 0

    def add(self, seq: int, length: float, owner: Any) -> None:
        if len(self.heap) < self.max_num_seqs:
            heapq.heappush(self.heap, (self.served + length, seq, owner))
        else:
            self.queue.append((seq, length, owner))

    def refill(self) -> None:
        while self.queue and len(self.heap) < self.max_num_seqs:
            seq, length, owner = self.queue.popleft()
            heapq.heappush(self.heap, (self.served + length, seq, owner))


@dataclass
class _Validation:
    left: int
    hybrid: list[_Replica] = field(default_factory=list)
    done_at: float | None = None


class _Sim:
    def __init__(self, cfg: SimConfig, profile: Profile) -> None:
        self.cfg, self.p = cfg, profile
        self.rng = random.Random(cfg.seed)
        self.buffer = ReplayBuffer(cfg.buffer_config())
        mns = max(1, profile.rollout.max_num_seqs)
        devices = cfg.replica_devices or tuple(range(cfg.replicas))
        self.replicas = [_Replica(mns, d) for d in devices]
        # The replicas of each shared device (a device of one replica is not shared).
        self.peers: dict[int, list[_Replica]] = {}
        for r in self.replicas:
            self.peers.setdefault(r.device, []).append(r)
        self.peers = {d: rs for d, rs in self.peers.items() if len(rs) > 1}
        self.lengths = [
            max(1, min(int(x), cfg.max_tokens)) for x in profile.rollout.response_lengths
        ] or [cfg.max_tokens]
        self.t = 0.0
        self.seq = 0
        self.version = 0
        self.paused = False
        self.groups: dict[str, _Group] = {}
        self.running = 0
        self.busy_s = 0.0
        self.tokens = 0
        self.val: _Validation | None = None
        self.staleness: Counter = Counter()
        self.spans: Counter = Counter()
        self.evicted_spans: Counter = Counter()
        self.steps: list[StepRecord] = []
        self._deadline = float("inf")

    # ---- rollout -----------------------------------------------------------------------
    def _load(self, r: _Replica) -> int:
        """What a replica holds, counted as the profile's curve counts it: "calls" (a
        group call's n sequences until its last ends, as the trace shows them) or
        "sequences" (each one until it ends, queued ones included)."""
        return r.outstanding if self.p.rollout.counts == "calls" else len(r.heap) + len(r.queue)

    def _rate(self, r: _Replica) -> float:
        """Tokens/s of each decoding request: its replica's rate for what it holds, shared
        by the ones decoding. Replicas on one device (`SimConfig.replica_devices`) share
        its time: a lone replica keeps its device `device_busy` busy, so k replicas with
        requests slow each other by max(1, k x device_busy) (time-slicing, as the OS
        shares pinned cores); a curve measured with `shared_by` replicas on the device
        had that slowdown in it already."""
        c = len(r.heap)
        if not c:
            return 0.0
        ro = self.p.rollout
        rate = ro.rate(self._load(r), self.cfg.tp) / c
        peers = self.peers.get(r.device) if r.device is not None else None
        busy = sum(1 for q in peers if q.heap) if peers else 1
        if busy == ro.shared_by:
            return rate
        return rate * ro.slowdown(ro.shared_by) / ro.slowdown(busy)

    def _active(self) -> list[_Replica]:
        extra = self.val.hybrid if self.val is not None else []
        return [*self.replicas, *extra]

    def _feed(self) -> None:
        """The driver: fill free slots with prompts, start pending groups up to the cap."""
        free = self.buffer.free_slots()
        if free:
            self.buffer.submit([{}] * free)
        while self.running < self.cfg.max_concurrent_groups:
            taken = self.buffer.take_pending(1)
            if not taken:
                break
            pg = taken[0]
            g = _Group(pg.uid, self.version, self.cfg.n)
            self.groups[pg.uid] = g
            self.running += 1
            r = min(self.replicas, key=lambda r: r.outstanding)  # least in flight
            r.outstanding += self.cfg.n
            for _ in range(self.cfg.n):
                length = self.rng.choice(self.lengths)
                g.tokens += length
                g.longest = max(g.longest, length)
                self.seq += 1
                r.add(self.seq, length, g)

    def _start_validation(self, hybrid: bool) -> None:
        v = self.p.validation
        prompts = v.prompts
        if prompts <= 0:
            return
        length = max(1.0, v.response_tokens or (sum(self.lengths) / len(self.lengths)))
        extra = []
        if hybrid:
            extra = [
                _Replica(max(1, self.p.rollout.max_num_seqs))
                for _ in range(max(1, self.cfg.trainer_devices // self.cfg.tp))
            ]
        self.val = _Validation(prompts, extra)
        pool = [*self.replicas, *extra]
        for i in range(prompts):
            self.seq += 1
            r = pool[i % len(pool)]
            r.outstanding += 1
            r.add(self.seq, length, self.val)

    def _complete(self, r: _Replica) -> None:
        _, _, owner = heapq.heappop(r.heap)
        r.refill()
        if isinstance(owner, _Validation):
            r.outstanding -= 1
            owner.left -= 1
            if owner.left == 0:
                owner.done_at = self.t
            return
        owner.left -= 1
        if owner.left == 0:
            r.outstanding -= self.cfg.n
            trajectories = [(owner.started_version, self.version)] * self.cfg.n
            self.buffer.finish(owner.uid, trajectories)
            self.running -= 1
            self.tokens += owner.tokens

    def _next_completion(self) -> float:
        if self.paused:
            return float("inf")
        best = float("inf")
        for r in self._active():
            if r.heap:
                rate = self._rate(r)
                if rate > 0:
                    best = min(best, (r.heap[0][0] - r.served) / rate)
        return max(0.0, best)

    def _advance(self, dt: float) -> None:
        if dt <= 0:
            return
        if not self.paused:
            for r in self._active():
                if r.heap:
                    r.served += self._rate(r) * dt
            if self.running > 0:
                self.busy_s += dt
        self.t += dt

    def _pop_done(self) -> None:
        if self.paused:
            return
        for r in self._active():
            while r.heap and r.heap[0][0] <= r.served + _EPS * max(1.0, r.served):
                self._complete(r)

    def run_until(self, done) -> None:
        """Advance the clock event by event, feeding the rollout, until `done()`; never
        past `self._deadline`."""
        while True:
            self._feed()
            if done():
                return
            dt = min(self._next_completion(), self._deadline - self.t)
            if dt == float("inf"):
                raise RuntimeError(
                    f"simulation stalled at t={self.t:.3f}s: nothing in flight, trainer waiting "
                    f"(buffer {self.buffer.counts()})"
                )
            self._advance(dt)
            self._pop_done()

    def wait_for(self, seconds: float) -> None:
        self._deadline = self.t + seconds
        self.run_until(lambda: self.t >= self._deadline - _EPS)

    def wait_until(self, predicate) -> None:
        self._deadline = float("inf")
        self.run_until(predicate)

    # ---- trainer -----------------------------------------------------------------------
    def _train_s(self, groups: list[Any]) -> float:
        """The train phase: per mini-batch, `rows` rows padded to the prompt plus the
        batch's longest response (TrajectoryBatch.pad pads the whole batch), forward +
        backward + one optimizer step per epoch; a forward more for decoupled PPO."""
        c, tp = self.cfg, self.p.trainer
        if c.layout == "packed":  # the per-row cost is linear in length: the mean decides
            seq_len = c.prompt_len + sum(self.groups[g.uid].tokens for g in groups) / (
                len(groups) * c.n
            )
        else:
            seq_len = c.prompt_len + max(self.groups[g.uid].longest for g in groups)
        rows = c.ppo_mini_batch_size * c.n
        per_mb = c.ppo_epochs * tp.update_s(rows, seq_len, c.trainer_devices)
        seconds = tp.overhead_s + c.parameter_sync_step * per_mb
        if c.old_log_prob_source == "trainer":
            seconds += tp.forward_s(len(groups) * c.n, seq_len, c.trainer_devices)
        return seconds

    def _train_for(self, seconds: float) -> None:
        """Let the train phase of `seconds` (at the profile's run level) go by. A contended
        trainer (`TrainerProfile.contended`) was measured at that level with the rollout
        decoding beside it: while no replica decodes it runs `run_level` times faster."""
        level = self.p.trainer.run_level
        if not self.p.trainer.contended or level <= 1.0:
            self.wait_for(seconds)
            return
        left = seconds / level  # the phase in seconds of the trainer alone
        while left > _EPS * max(1.0, seconds):
            self._feed()
            decoding = not self.paused and any(r.heap for r in self._active())
            rate = 1.0 / level if decoding else 1.0
            dt = min(self._next_completion(), left / rate)
            self._advance(dt)
            left -= dt * rate
            self._pop_done()

    def _val_done(self) -> bool:
        return self.val is None or self.val.left == 0

    def run(self) -> SimResult:
        c = self.cfg
        self.wait_until(lambda: True)  # submit the warm-up batches
        if c.val_before_train:
            self._start_validation(c.hybrid)
            self.wait_until(self._val_done)
            if c.hybrid and self.val is not None:
                self.wait_for(self.p.validation.hybrid_overhead_s)
            self.val = None
        for step in range(1, c.steps + 1):
            t_begin, busy0, tokens0 = self.t, self.busy_s, self.tokens
            self.buffer.begin_step(step)
            evicted: list[Any] = []

            def ready(evicted=evicted) -> bool:
                stale = self.buffer.evict_stale()
                for g in stale:
                    evicted.append(g)
                    self.evicted_spans[g.span(self.buffer.current_step)] += 1
                    self.groups.pop(g.uid, None)
                return self.buffer.ready(c.train_batch_size)

            self.wait_until(ready)
            wait_s = self.t - t_begin
            batch = self.buffer.sample(c.train_batch_size)
            policy = self.version
            for g in batch:
                for started, _ in g.trajectories:
                    self.staleness[policy - started] += 1
                    self.spans[g.span(step)] += 1
            train_s = self._train_s(batch)
            for g in batch:
                self.groups.pop(g.uid, None)
            t0 = self.t
            self._train_for(train_s)
            train_s = self.t - t0
            t0 = self.t
            if self.val is not None:  # the last validation sees only its own version
                self.wait_until(self._val_done)
                self.val = None
            sync_s = self.p.sync.sync_s()
            self.paused = True
            self.wait_for(sync_s)
            self.paused = False
            self.version += 1
            sync_s = self.t - t0
            t0 = self.t
            if (c.test_freq > 0 and step % c.test_freq == 0) or step == c.steps:
                self._start_validation(c.hybrid)
                if c.hybrid and self.val is not None:
                    self.wait_until(self._val_done)
                    self.wait_for(self.p.validation.hybrid_overhead_s)
                    self.val = None
            val_s = self.t - t0
            self.steps.append(
                StepRecord(
                    step=step,
                    step_s=self.t - t_begin,
                    wait_s=wait_s,
                    train_s=train_s,
                    sync_s=sync_s,
                    val_s=val_s,
                    busy_s=self.busy_s - busy0,
                    tokens=self.tokens - tokens0,
                    evicted=len(evicted),
                )
            )
        self.buffer.check_accounting()
        return SimResult(
            c, self.steps, self.staleness, self.spans, self.evicted_spans,
            self.buffer.counts(), self.t,
        )  # fmt: skip


def simulate(config: SimConfig, profile: Profile) -> SimResult:
    """Run `config.steps` global steps of the job on `profile`'s timings."""
    return _Sim(config, profile).run()

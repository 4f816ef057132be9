"""A machine profile: what the simulator needs to know about the trainer, the replicas and
the weight sync, as measured by `offbeat profile` (JSON, schema `offbeat-profile/1`).

Knows nothing about how the figures were measured (`offbeat.planner.measure` does that)
nor about the pipeline they drive (`offbeat.planner.simulator`). Each part answers the
questions the simulator asks: seconds to update on so many rows of so many tokens, a
replica's tokens/s with so many requests in flight, seconds to sync so many bytes.
`scaled` moves a profile measured on a few devices to other trainer sizes and replica
widths, under assumptions it spells out (`SCALING_ASSUMPTIONS`).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "offbeat-profile/1"

__all__ = [
    "SCALING_ASSUMPTIONS",
    "SCHEMA",
    "Profile",
    "RolloutProfile",
    "SyncProfile",
    "TrainerPoint",
    "TrainerProfile",
    "ValidationProfile",
    "interpolate",
]

# What `plan` assumes when it uses a profile at another size; printed with every plan.
SCALING_ASSUMPTIONS = (
    "trainer: data-parallel ranks split each mini-batch's rows evenly; throughput scales "
    "by the ranks ratio times trainer.dp_efficiency per doubling (the optimizer step does not "
    "shrink)",
    "rollout: replicas on devices of their own are independent (one balancer, no shared "
    "bandwidth); replicas that share a device (CPU replicas on the same runtime.rollout_cpus) "
    "time-slice it: k with requests each decode max(1, k x rollout.device_busy) slower; a "
    "replica at tensor parallelism t decodes (t / measured tp) x rollout.tp_efficiency per "
    "doubling as fast, at the measured concurrency curve",
    "weight sync: transfer time grows with bytes at the measured bandwidth, a fixed part "
    "per sync; replicas receive in parallel",
    "response lengths: the measured distribution (the policy does not change with the split)",
)


def interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear y(x) through the points; flat beyond the ends."""
    if not xs:
        raise ValueError("interpolate: no points")
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class TrainerPoint:
    """One measured mini-batch shape: `rows` sequences padded to `seq_len` tokens."""

    seq_len: int
    rows: int
    forward_s: float  # log-prob forward (no grad) of all rows
    backward_s: float  # forward with grad + backward of all rows, minus forward_s
    optimizer_s: float  # clip + optimizer step + LR step, once per update


@dataclass
class TrainerProfile:
    """The train engine on `devices` data-parallel ranks."""

    devices: int = 1
    points: list[TrainerPoint] = field(default_factory=list)
    dp_efficiency: float = 0.9  # throughput kept per doubling of ranks (assumed unless measured)
    # Seconds a step spends around the updates (advantages, padding, batch assembly):
    # measured in the short run as train phase minus the engine's updates.
    overhead_s: float = 0.0
    # The points give the shape against sequence length; the short run gives the level:
    # its updates' seconds over the points' at the run's padded length (1: as measured).
    run_level: float = 1.0
    # True when the short run's trainer shared its hardware with the replicas (CPU cores of
    # one machine, or one GPU: runtime.share_trainer_gpu): its level was measured with
    # the rollout decoding beside it, and the points were measured alone. The simulator
    # then trains at the points' own speed while no replica decodes (sync mode, a wait)
    # and at `run_level` while one does.
    contended: bool = False

    def _per_row(self, seq_len: float, what: str) -> float:
        """Seconds per row at `seq_len`: a least-squares line a + b x seq_len through the
        points (compute grows with tokens; one noisy point must not bend the curve),
        never below the smallest point's per-token cost times seq_len's share of it."""
        pts = sorted(self.points, key=lambda p: p.seq_len)
        if not pts:
            raise ValueError("trainer profile has no points")
        xs = [float(p.seq_len) for p in pts]
        if what == "forward":
            ys = [p.forward_s / p.rows for p in pts]
        else:
            ys = [(p.forward_s + p.backward_s) / p.rows for p in pts]
        if len(xs) == 1:
            return self.run_level * ys[0] * seq_len / xs[0]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
        b = max(0.0, b)
        a = my - b * mx
        return self.run_level * max(a + b * seq_len, min(ys) * min(1.0, seq_len / xs[0]))

    def _speedup(self, devices: int) -> float:
        if devices == self.devices:
            return 1.0
        ratio = devices / self.devices
        return ratio * self.dp_efficiency ** math.log2(ratio) if ratio > 1 else ratio

    def optimizer_s(self) -> float:
        return self.run_level * sum(p.optimizer_s for p in self.points) / max(1, len(self.points))

    def update_s(self, rows: int, seq_len: float, devices: int | None = None) -> float:
        """One mini-batch update: forward + backward of `rows` rows, one optimizer step."""
        d = devices or self.devices
        return rows * self._per_row(seq_len, "update") / self._speedup(d) + self.optimizer_s()

    def forward_s(self, rows: int, seq_len: float, devices: int | None = None) -> float:
        d = devices or self.devices
        return rows * self._per_row(seq_len, "forward") / self._speedup(d)


@dataclass
class RolloutProfile:
    """One replica at tensor parallelism `tp`: tokens/s against requests in flight, and
    the response lengths of the recipe's policy (tokens per sample)."""

    tp: int = 1
    concurrency: list[float] = field(default_factory=lambda: [1.0])
    tokens_per_s: list[float] = field(default_factory=lambda: [1.0])
    response_lengths: list[int] = field(default_factory=list)
    max_num_seqs: int = 256  # requests a replica decodes at once; the rest queue
    tp_efficiency: float = 0.8  # decode speed kept per doubling of tp (assumed)
    # What `concurrency` counts: "calls" (the sequences of the calls in flight, a group
    # call's n until its last one ends: what `offbeat profile` reads from the trace) or
    # "sequences" (each decoding or queued sequence, an engine benchmark's axis).
    counts: str = "calls"
    # Where the measured replica ran: its cores (CPU, runtime.rollout_cpus' share; []:
    # not pinned or not a CPU), how many replicas shared them (their curve has that
    # sharing in it), and the fraction of those cores it kept busy while it had requests
    # in flight (1.0: it saturates them, assumed unless measured). Replicas that share a
    # device slow each other by max(1, replicas with requests x device_busy).
    cores: list[int] = field(default_factory=list)
    shared_by: int = 1
    device_busy: float = 1.0
    device_busy_measured: bool = False

    def slowdown(self, busy_replicas: int) -> float:
        """How much slower each of `busy_replicas` replicas with requests on one device
        decodes than one alone: time-slicing of what they keep busy."""
        return max(1.0, busy_replicas * self.device_busy)

    def rate(self, in_flight: int, tp: int | None = None) -> float:
        """The replica's tokens/s with `in_flight` requests on it: the measured curve's
        monotone envelope (more in flight never decodes slower: a dip is noise from
        shared cores), interpolated."""
        if in_flight <= 0:
            return 0.0
        envelope, top = [], 0.0
        for y in self.tokens_per_s:
            top = max(top, y)
            envelope.append(top)
        r = interpolate(self.concurrency, envelope, float(in_flight))
        t = tp or self.tp
        if t != self.tp:
            ratio = t / self.tp
            r *= ratio * self.tp_efficiency ** math.log2(ratio) if ratio > 1 else ratio
        return r


@dataclass
class SyncProfile:
    """A weight sync of `bytes` to every replica (replicas receive in parallel)."""

    bytes: int = 0
    transfer_gbps: float = 1.0  # GB/s of the transfer phase
    abort_s: float = 0.0  # abort in-flight requests
    fixed_s: float = 0.0  # release/resume KV, resume generation and the rest of the sync
    points: list[dict[str, float]] = field(default_factory=list)  # measured (bytes, s)

    def sync_s(self, nbytes: int | None = None) -> float:
        b = self.bytes if nbytes is None else nbytes
        return self.abort_s + self.fixed_s + b / (self.transfer_gbps * 1e9)


@dataclass
class ValidationProfile:
    """One validation pass: `prompts` greedy samples of `response_tokens` tokens each."""

    prompts: int = 0
    response_tokens: float = 0.0  # mean per sample
    seconds: float = 0.0  # measured on the job's replicas (background validation)
    hybrid_overhead_s: float = 0.0  # wake, sync, join and sleep of hybrid replicas


@dataclass
class Profile:
    trainer: TrainerProfile = field(default_factory=TrainerProfile)
    rollout: RolloutProfile = field(default_factory=RolloutProfile)
    sync: SyncProfile = field(default_factory=SyncProfile)
    validation: ValidationProfile = field(default_factory=ValidationProfile)
    # The job as profiled: recipe, overrides, device kind, prompt length, model bytes.
    job: dict[str, Any] = field(default_factory=dict)
    # The short run's own per-step figures (the measured side of a calibration).
    measured: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)  # cpu count, load average, devices
    schema: str = SCHEMA

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"profile schema={d.get('schema')!r}: expected {SCHEMA!r}")
        t = dict(d.get("trainer", {}))
        t["points"] = [TrainerPoint(**p) for p in t.get("points", [])]
        if "contended" not in t:  # a profile written before the field: from its job
            job = d.get("job", {})
            t["contended"] = job.get("device") == "cpu" or (
                "runtime.share_trainer_gpu=true" in job.get("overrides", [])
            )
        return cls(
            trainer=TrainerProfile(**t),
            rollout=RolloutProfile(**d.get("rollout", {})),
            sync=SyncProfile(**d.get("sync", {})),
            validation=ValidationProfile(**d.get("validation", {})),
            job=dict(d.get("job", {})),
            measured=dict(d.get("measured", {})),
            machine=dict(d.get("machine", {})),
        )

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--profile {path}: cannot read a profile ({e})") from e

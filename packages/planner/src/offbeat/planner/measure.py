"""`offbeat profile`: measure this machine for one recipe and write a `Profile`.

Two measurements, both on the job's own code:
1. a short run of the recipe as configured (its replicas, its trainer, its weight sync),
   traced: the response lengths (its recorded batches), each replica's tokens/s against
   the sequences it had in flight (the trace's request lanes), every sync's phases and
   bytes, the validation pass before step 1, and the run's own step figures;
2. the job's train engine, built in this process as the job builds an in-driver trainer,
   timed on batches of the job's shape at a ladder of sequence lengths: forward
   (log-probs), forward + backward per micro-batch and the optimizer step (its spans).

Knows nothing about the simulator; the extraction functions (`*_from_trace`) are plain
functions of the trace's events, tested without an engine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offbeat.planner._cores import CoreSampler, busy_fraction, union
from offbeat.planner.profile import (
    Profile,
    RolloutProfile,
    SyncProfile,
    TrainerPoint,
    TrainerProfile,
    ValidationProfile,
)

if TYPE_CHECKING:
    from offbeat.core.config.run import RunConfig

__all__ = [
    "busy_intervals_from_trace",
    "measure_trainer",
    "profile_recipe",
    "replica_cores",
    "rollout_curve_from_trace",
    "run_figures",
    "spans_named",
]

CONCURRENCY_BINS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def spans_named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and e.get("name") == name]


def _track_names(events: list[dict[str, Any]]) -> dict[tuple[int, int], str]:
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}  # fmt: skip
    return {
        (e["pid"], e["tid"]): f"{procs.get(e['pid'], '?')}/{e['args']['name']}"
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }


def _replica_spans(
    events: list[dict[str, Any]], since_us: float
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[tuple[float, float]]]]:
    """Per replica (its track's process name): its request lanes' "generate" spans from
    `since_us` on, and its syncs' (start, end) in trace microseconds."""
    names = _track_names(events)
    generate: dict[str, list[dict[str, Any]]] = defaultdict(list)
    syncs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        proc, _, thread = names.get((e["pid"], e["tid"]), "").rpartition("/")
        if e["name"] == "generate" and thread.startswith("lane") and e["ts"] >= since_us:
            generate[proc].append(e)
        elif thread == "sync" and e["name"].startswith("sync v"):
            syncs[proc].append((e["ts"], e["ts"] + e["dur"]))
    return generate, syncs


def rollout_curve_from_trace(
    events: list[dict[str, Any]], since_us: float = 0.0
) -> tuple[list[float], list[float]]:
    """(sequences in flight, tokens/s) of one replica on average, from the request lanes:
    each "generate" span's tokens are spread evenly over it; time inside a sync of that
    replica is left out (nothing decodes then); the time of each replica is binned by how
    many sequences it had in flight (powers of two) and each bin's rate is its tokens
    over its seconds. Only spans starting at `since_us` or later count (the job's steps,
    not the validation before them, whose requests share the replica)."""
    by_replica, syncs = _replica_spans(events, since_us)
    tokens: dict[int, float] = defaultdict(float)
    seconds: dict[int, float] = defaultdict(float)
    for replica, spans in by_replica.items():
        windows = syncs.get(replica, [])
        edges = sorted(
            {s["ts"] for s in spans} | {s["ts"] + s["dur"] for s in spans}
            | {w for window in windows for w in window}
        )  # fmt: skip
        marks = [(s["ts"], s["ts"] + s["dur"], int(s.get("args", {}).get("n", 1)),
                  float(s.get("args", {}).get("tokens", 0)) / max(1, s["dur"])) for s in spans]  # fmt: skip
        for a, b in itertools.pairwise(edges):
            mid = (a + b) / 2
            if any(w0 <= mid < w1 for w0, w1 in windows):
                continue
            seqs, rate = 0, 0.0
            for s0, s1, n, r in marks:
                if s0 <= mid < s1:
                    seqs += n
                    rate += r
            if seqs == 0:
                continue
            k = min(CONCURRENCY_BINS, key=lambda c: abs(c - seqs) / c)
            tokens[k] += rate * (b - a)
            seconds[k] += (b - a) / 1e6
    xs = [float(k) for k in sorted(seconds) if seconds[k] > 0]
    ys = [tokens[int(k)] / seconds[int(k)] for k in xs]
    return xs, ys


def run_figures(rows: list[dict[str, float]], skip: int = 1) -> dict[str, Any]:
    """The run's per-step figures (metrics.jsonl step rows), their means after `skip`."""
    steps = [r for r in rows if "timing/step_s" in r]
    keys = {
        "step_s": "timing/step_s",
        "trainer_idle": "perf/trainer_idle_frac",
        "rollout_idle": "perf/rollout_idle_frac",
        "tokens_per_s": "perf/tokens_per_s",
        "train_s": "timing/train_s",
        "sync_s": "timing/sync_s",
        "wait_s": "timing/generate_wait_s",
    }
    window = steps[skip:] if len(steps) > skip else steps
    out: dict[str, Any] = {"steps": len(steps), "skip_steps": skip}
    for short, key in keys.items():
        vals = [r[key] for r in window if key in r]
        if vals:
            out[short] = statistics.fmean(vals)
    out["per_step"] = [{k: r.get(v) for k, v in keys.items()} for r in steps]
    return out


def _sync_profile(rows: list[dict[str, float]]) -> SyncProfile:
    steps = [r for r in rows if "timing/sync_s" in r]
    if not steps:
        return SyncProfile()
    med = lambda k: statistics.median(r.get(k, 0.0) for r in steps)  # noqa: E731
    nbytes = int(med("sync/bytes"))
    transfer = med("timing/sync_transfer_s")
    abort = med("timing/sync_abort_s")
    total = med("timing/sync_s")
    return SyncProfile(
        bytes=nbytes,
        transfer_gbps=(nbytes / transfer / 1e9) if transfer > 0 else 1e3,
        abort_s=abort,
        fixed_s=max(0.0, total - abort - transfer),
        points=[{"bytes": r.get("sync/bytes", 0.0), "transfer_s": r.get("timing/sync_transfer_s", 0.0),
                 "sync_s": r["timing/sync_s"], "abort_s": r.get("timing/sync_abort_s", 0.0)}
                for r in steps],
    )  # fmt: skip


def _recorded_lengths(record_dir: Path) -> tuple[list[int], float, float]:
    """Response lengths of every recorded trajectory, the mean prompt length and the mean
    padded width (prompt + response columns: what the trainer's rows are)."""
    from safetensors.torch import load_file

    lengths: list[int] = []
    prompts: list[float] = []
    widths: list[float] = []
    for f in sorted(record_dir.glob("step_*.safetensors")):
        t = load_file(str(f))
        lengths += [int(x) for x in t["response_mask"].sum(dim=1).tolist()]
        prompts += t["prompt_mask"].sum(dim=1).tolist()
        widths.append(float(t["prompt_ids"].shape[1] + t["response_ids"].shape[1]))
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0  # noqa: E731
    return lengths, mean(prompts), mean(widths)


def measure_trainer(cfg: RunConfig, seq_lens: list[int], *, repeats: int = 2) -> TrainerProfile:
    """The job's train engine (built in this process, as an in-driver trainer) on
    mini-batches of the job's shape: rows = ppo_mini_batch_size x n, each padded to
    `seq_len` tokens, a quarter of them response. Median of `repeats` after one warm-up."""
    import torch

    from offbeat.core import trace
    from offbeat.core.registry import TRAIN_ENGINES

    engine = TRAIN_ENGINES.get(cfg.actor.engine).from_job_config(cfg)
    rows = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    vocab = 64
    points = []
    for seq_len in seq_lens:
        resp = max(1, seq_len // 4)
        g = torch.Generator().manual_seed(seq_len)
        batch = {
            "input_ids": torch.randint(3, vocab, (rows, seq_len), generator=g),
            "attention_mask": torch.ones(rows, seq_len, dtype=torch.long),
            "response_mask": torch.ones(rows, resp, dtype=torch.long),
            "advantages": torch.randn(rows, resp, generator=g),
            "rollout_log_probs": -torch.rand(rows, resp, generator=g),
        }
        batch["old_log_probs"] = batch["rollout_log_probs"].clone()
        fwd, upd, opt = [], [], []
        for i in range(repeats + 1):
            tracer = trace.Tracer(None)
            token = trace.activate(tracer)
            try:
                t0 = time.perf_counter()
                engine.compute_log_probs(batch, 1.0)
                f = time.perf_counter() - t0
                engine.update(dict(batch), 1.0)
            finally:
                trace.deactivate(token)
            asyncio.run(tracer.flush())
            ev = tracer.events()
            if i == 0:
                continue  # warm-up
            fwd.append(f)
            upd.append(sum(e["dur"] for e in spans_named(ev, "micro-batch")) / 1e6)
            opt.append(sum(e["dur"] for e in spans_named(ev, "optimizer_step")) / 1e6)
        f, u, o = statistics.median(fwd), statistics.median(upd), statistics.median(opt)
        points.append(TrainerPoint(seq_len=seq_len, rows=rows, forward_s=f,
                                   backward_s=max(0.0, u - f), optimizer_s=o))  # fmt: skip
    return TrainerProfile(devices=cfg.resources.trainer_devices, points=points)


def _load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def short_run_overrides(work: Path, steps: int) -> list[str]:
    """What `offbeat profile` adds to the user's overrides for its short run."""
    return [
        f"trainer.total_training_steps={steps}", "trainer.trace=true", "trainer.test_freq=0",
        "trainer.val_before_train=true", "trainer.save_freq=-1", "trainer.resume=false",
        f"trainer.log_dir={work}", "trainer.experiment_name=profile",
        "trainer.loggers=[jsonl]", f"rollout.record.dir={work / 'record'}",
    ]  # fmt: skip


def replica_cores(cfg: RunConfig) -> tuple[list[int], int]:
    """(cores of replica 0, replicas on those cores): its share of runtime.rollout_cpus on
    CPU ([] when not pinned or not a CPU, with every replica counted as sharing when
    unpinned on CPU)."""
    from offbeat.core.config.support import replica_devices
    from offbeat.planner.plan import replica_devices_of

    replicas = max(1, cfg.resources.rollout_devices // replica_devices(cfg.rollout))
    devices = replica_devices_of(cfg, replicas)
    shared_by = devices.count(devices[0]) if devices else 1
    cpus = list(getattr(getattr(cfg, "runtime", None), "rollout_cpus", None) or [])
    if cfg.resources.device != "cpu" or not cpus:
        return [], shared_by
    from offbeat.core.cpus import share_of

    return share_of(cpus, replicas, 0), shared_by


def busy_intervals_from_trace(
    events: list[dict[str, Any]], since_us: float = 0.0
) -> list[tuple[float, float]]:
    """(start, end) seconds on the trace's clock while the first replica (by track name)
    had a request in flight (its "generate" lane spans from `since_us` on), its syncs
    left out."""
    events_of, sync_us = _replica_spans(events, since_us)
    spans = {
        r: [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in es] for r, es in events_of.items()
    }
    syncs = {r: [(a / 1e6, b / 1e6) for a, b in ws] for r, ws in sync_us.items()}
    if not spans:
        return []
    first = min(spans)
    out = []
    for a, b in union(spans[first]):
        for s0, s1 in union(syncs.get(first, [])):
            if s1 <= a or s0 >= b:
                continue
            if s0 > a:
                out.append((a, s0))
            a = max(a, s1)
        if b > a:
            out.append((a, b))
    return out


@contextmanager
def _tracer_origins():
    """The clock origin of every tracer the job makes (its trace's times count from it)."""
    from offbeat.core.trainer import tracking

    origins: list[float] = []
    make = tracking.make_tracer

    def make_tracer(*args, **kwargs):
        tracer = make(*args, **kwargs)
        if tracer is not None:
            origins.append(tracer.origin)
        return tracer

    tracking.make_tracer = make_tracer
    try:
        yield origins
    finally:
        tracking.make_tracer = make


def profile_recipe(
    recipe: str, overrides: list[str], *, steps: int = 6, out_dir: str | Path | None = None
) -> Profile:
    """Run `recipe` with `overrides` for `steps` traced steps, then time its train engine;
    return the profile (the caller writes it). On CPU with pinned replicas, the CPU time of
    replica 0's processes while it had requests in flight gives `rollout.device_busy`."""
    from offbeat.core.cli import load_recipe_config
    from offbeat.core.trainer.job import run_job

    work = Path(out_dir or tempfile.mkdtemp(prefix="offbeat-profile-"))
    _, cfg = load_recipe_config(recipe, [*overrides, *short_run_overrides(work, steps)])
    cores, shared_by = replica_cores(cfg)
    load_before = _load_avg()
    t0 = time.perf_counter()
    with _tracer_origins() as origins, CoreSampler(cores if shared_by == 1 else []) as cpu:
        summary = asyncio.run(run_job(cfg))
    run_s = time.perf_counter() - t0
    prof = profile_from_run(cfg, work)
    if cpu.found and origins:  # no process on the cores (Ray elsewhere): not measured
        events = json.loads((work / "profile" / "trace.json").read_text())["traceEvents"]
        first = min((e["ts"] for e in events if e.get("name") == "step 1"), default=0.0)
        busy = [(origins[-1] + a, origins[-1] + b)
                for a, b in busy_intervals_from_trace(events, since_us=first)]  # fmt: skip
        u = busy_fraction(cpu.samples, busy, len(cores))
        if u is not None:
            prof.rollout.device_busy, prof.rollout.device_busy_measured = round(u, 4), True
    prof.job.update(recipe=recipe, overrides=list(overrides), steps=steps)
    prof.measured.update(run_s=run_s, counts=summary.get("counts", {}))
    prof.machine["load_avg_before"] = load_before
    return prof


def profile_from_run(cfg: RunConfig, work: Path, trainer: TrainerProfile | None = None) -> Profile:
    """The profile of the short run in `work` (its metrics, trace and recorded batches);
    `trainer`: engine points measured already (None: measure them now)."""
    from offbeat.core.trainer.prepare import prepare

    run_dir = work / "profile"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]

    lengths, prompt_mean, width = _recorded_lengths(work / "record")
    first_step = min((e["ts"] for e in events if e.get("name") == "step 1"), default=0.0)
    xs, ys = rollout_curve_from_trace(events, since_us=first_step)
    replicas = max(1, cfg.resources.rollout_devices // cfg.rollout.tensor_parallel_size)
    kwargs = dict(cfg.rollout.engine_kwargs or {})
    cores, shared_by = replica_cores(cfg)
    rollout = RolloutProfile(
        tp=cfg.rollout.tensor_parallel_size, concurrency=xs or [1.0], tokens_per_s=ys or [1.0],
        response_lengths=lengths, max_num_seqs=int(kwargs.get("max_num_seqs", 256)),
        cores=cores, shared_by=shared_by,
    )  # fmt: skip
    val_spans = spans_named(events, "validation_wait")
    before = [e for e in val_spans if e["ts"] < first_step]
    step_rows = [r for r in rows if "timing/step_s" in r]
    val_rows = [r for r in rows if "val/reward" in r]
    validation = ValidationProfile(
        prompts=int(getattr(cfg.task, "n_val", 0) or 0) if hasattr(cfg, "task") else 0,
        response_tokens=statistics.fmean(
            [r["val/response_length"] for r in val_rows if "val/response_length" in r] or [0.0]
        ),
        seconds=before[0]["dur"] / 1e6 if before else 0.0,
    )  # fmt: skip

    if trainer is None:
        max_len = int(
            kwargs.get("max_model_len", cfg.data.max_prompt_length + cfg.rollout.max_tokens)
        )
        ladder = sorted({max(4, int(width)), 16, 32, 64, max_len})
        trainer = measure_trainer(prepare(cfg).cfg, [s for s in ladder if s <= max_len])
    # The level from the run: its mini-batch updates (after step 1's) against the points
    # at its padded width; what its train phases hold beyond the updates is overhead.
    pss = cfg.async_training.parameter_sync_step
    mb = spans_named(events, "mini-batch")[pss:]
    train = [r["timing/train_s"] for r in step_rows[1:]]
    if mb and train and width > 0:
        rows_mb = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
        per_mb = statistics.fmean(e["dur"] for e in mb) / 1e6
        trainer.run_level = per_mb / trainer.update_s(rows_mb, width)
        trainer.contended = cfg.resources.device == "cpu" or bool(cfg.runtime.share_trainer_gpu)
        trainer.overhead_s = max(0.0, statistics.fmean(train) - pss * per_mb)

    return Profile(
        trainer=trainer,
        rollout=rollout,
        sync=_sync_profile(step_rows),
        validation=validation,
        job={
            "device": cfg.resources.device,
            "replicas": replicas, "trainer_devices": cfg.resources.trainer_devices,
            "prompt_len_mean": prompt_mean, "padded_len_mean": width, "max_tokens": cfg.rollout.max_tokens,
            "n": cfg.rollout.n, "train_batch_size": cfg.data.train_batch_size,
            "mode": cfg.trainer.mode,
        },
        measured=run_figures(rows),
        machine={"cpus": os.cpu_count(), "load_avg_after": _load_avg(),
                 "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
    )  # fmt: skip

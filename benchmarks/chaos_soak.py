"""Chaos soak: the default job with kills at seeded random times, every prompt of the data
order accounted for across the resumes, against the same job without kills.

Kills (each at a step drawn from `--seed`; each fires once over all attempts):
- the job: the job's process (`offbeat run separate_async ...`) gets SIGKILL from this
  script a seeded fraction of a second after its metrics file shows a planned step (the
  step's work since the last checkpoint is lost, as in a crash of the machine's driver);
  this script then runs `offbeat run separate_async ... trainer.resume=true`, which
  resumes from the newest complete checkpoint (fresh Ray, replicas and trainer);
- a rollout replica: its actor is killed (`ray.kill`: SIGKILL of the actor's process, its
  vLLM engine core dies with it) a seeded fraction of a second after a weight sync,
  mid-generation; the job replaces it;
- a rollout replica's engine alone (`--engine-kills N`): SIGKILL of its vLLM engine-core
  process (found among the replica actor's process tree), the Ray actor left alive, a
  seeded fraction of a second after a weight sync; the replica's failed calls and its
  health probe find the engine dead (vLLM's EngineDeadError) and the job removes and
  replaces it;
- a hybrid (validation) replica: killed while it answers a validation request leased to
  it (`trainer.validate_on_trainer_devices=true` in both runs); the validation goes on on
  the standalone replica, later validations without it.
- a trainer rank (`--rank-kills N`; the trainer runs as a one-rank group beside the
  hybrid replica): SIGKILL of the rank's process a seeded fraction of a second after a
  weight sync; the run fails with TrainerRankFailed and restarts by itself in the same
  process from the newest checkpoint (`trainer.max_restarts`, null: 2 with save_freq > 0).
- an OPD teacher replica or a GenRM judge replica (`--recipe opd --teacher-kills N`,
  `--recipe genrm --judge-kills N`): its actor is killed a seeded fraction of a second
  after a weight sync, while the rollout's groups are being scored on it; the job
  replaces it in its bundle and the calls in flight on it retry on the replacement (a
  teacher is drawn per kill from the seed). These recipes build their teachers / judge
  first (cached under `OFFBEAT_CACHE_DIR`: 6-12 min each on 2 cores when cold).

Each attempt is a process of its own running offbeat's command line (`offbeat.core.cli
.main`, what `offbeat run` calls); in it this script only adds the replica and hybrid
kills and, at the end, writes the prompt ledger's counts. Prints the kills survived, what
the job said, prompts lost and duplicated (from the last run's ledger, which raises on
either), the wall time against the same job without kills from the same invocation, and
the load average (1 min, sampled every 5 s: min / median / max) over each run.

    uv run --frozen --no-sync python benchmarks/chaos_soak.py [--steps 100] [--seed 0]
        [--job-kills 2] [--replica-kills 2] [--engine-kills 1] [--hybrid-kills 1]
        [--rank-kills 1] [--save-freq 5]
        [--recipe separate_async|opd|genrm] [--teacher-kills 0] [--judge-kills 0] [key=value ...]

(--engine-kills and --rank-kills default to 0 with --recipe opd or genrm, as their recorded
runs were made.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HYBRID = [  # validation on a hybrid replica beside the trainer, on this CPU machine
    "trainer.validate_on_trainer_devices=true",
    "runtime.ray_num_cpus=3",
    "runtime.trainer_cpus=[]",
    "runtime.rollout_cpus=[]",
    "runtime.rollout_env={VLLM_CPU_OMP_THREADS_BIND: auto, VLLM_CPU_KVCACHE_SPACE: '1'}",
]


def plan(args) -> dict:
    rng = random.Random(args.seed)
    steps, vals = args.steps, range(args.test_freq, args.steps, args.test_freq)
    return {
        "job": sorted((s, rng.uniform(0.05, 1.0)) for s in rng.sample(range(2, steps), args.job_kills)),
        "replica": sorted(
            (s, rng.uniform(0.05, 1.0)) for s in rng.sample(range(1, steps), args.replica_kills)
        ),
        "hybrid": sorted(rng.sample(list(vals), args.hybrid_kills)),
        # teacher / judge kills: [step, delay, which teacher (an index; judges: 0)]
        "fixed": sorted(
            (s, rng.uniform(0.05, 1.0), rng.randrange(64))
            for s in rng.sample(range(1, steps), args.teacher_kills + args.judge_kills)
        ),
        "engine": sorted(
            (s, rng.uniform(0.05, 1.0)) for s in rng.sample(range(1, steps), args.engine_kills)
        ),
        "rank": sorted(
            (s, rng.uniform(0.05, 1.0)) for s in rng.sample(range(2, steps), args.rank_kills)
        ),
    }  # fmt: skip


# ---- inside an attempt's process -------------------------------------------------------
def _fired(events: Path) -> list[dict]:
    if not events.exists():
        return []
    return [json.loads(x) for x in events.read_text().splitlines() if x.strip()]


def _event(events: Path, **e) -> None:
    with events.open("a") as f:
        f.write(json.dumps({"t": time.time(), **e}) + "\n")


def child(plan_path: str, out_path: str, argv: list[str]) -> int:
    """One attempt: `offbeat run ...` with the planned replica and hybrid kills that have
    not fired yet in an earlier attempt; writes the last run's ledger counts to `out_path`."""
    import ray

    from offbeat.core.cli import main as cli_main
    from offbeat.core.runtime.group import TrainerGroup
    from offbeat.core.trainer import job as job_module
    from offbeat.core.trainer.fixed_replicas import FixedReplicas
    from offbeat.core.trainer.replicas import ReplicaPool

    p = json.loads(Path(plan_path).read_text())
    events = Path(p["events"])
    done = _fired(events)
    replica_at = {
        s: d for s, d in p["replica"] if not any(e.get("replica_step") == s for e in done)
    }
    hybrid_at = [s for s in p["hybrid"] if not any(e.get("hybrid_step") == s for e in done)]
    fixed_at = {
        s: (d, w) for s, d, w in p["fixed"] if not any(e.get("fixed_step") == s for e in done)
    }
    engine_at = {
        s: d for s, d in p.get("engine", []) if not any(e.get("engine_step") == s for e in done)
    }
    rank_at = {s: d for s, d in p.get("rank", []) if not any(e.get("rank_step") == s for e in done)}
    groups: list = []  # every trainer group started, the newest last
    tasks: list = []  # the engine kills under way (a reference keeps each alive)
    real_start = TrainerGroup.start.__func__

    async def start_group(cls, *a, **kw):
        group = await real_start(cls, *a, **kw)
        groups.append(group)
        return group

    real_sync, real_with, real_job, real_fixed = (
        ReplicaPool.sync, job_module.run_with_replicas, job_module.run_job, FixedReplicas.__init__,
    )  # fmt: skip
    validating: dict[str, int] = {}  # the step whose sync the trainer did last
    fixed: list = []  # every teacher's / the judges' FixedReplicas, in creation order

    def fixed_init(self, *a, **kw):
        real_fixed(self, *a, **kw)
        fixed.append(self)

    def kill_fixed(step: int, version: int) -> None:
        """Kill the first live replica of a teacher drawn by the plan (or of the judges)."""
        delay, which = fixed_at.pop(step)
        if not fixed:
            return
        target = sorted(fixed, key=lambda f: f.kind)[which % len(fixed)]

        def kill() -> None:
            if not target.servers:
                return
            victim = sorted(target.servers)[0]
            ray.kill(target.servers[victim].handle)
            _event(events, fixed_step=step, what=f"{target.kind} replica {victim} killed "
                   f"{delay:.2f} s after the sync of v{version}")  # fmt: skip

        asyncio.get_running_loop().call_later(delay, kill)

    async def sync(self, named_tensors, version):
        result = await real_sync(self, named_tensors, version)
        validating["version"] = version
        if version in replica_at and self.servers:
            delay = replica_at.pop(version)
            victim = sorted(self.servers)[0]
            handle = self.servers[victim].handle

            def kill() -> None:
                ray.kill(handle)
                _event(events, replica_step=version, what=f"replica {victim} killed "
                       f"{delay:.2f} s after the sync of v{version}")  # fmt: skip

            asyncio.get_running_loop().call_later(delay, kill)
        if version in engine_at and self.servers:
            delay = engine_at.pop(version)
            victim = sorted(self.servers)[0]
            handle = self.servers[victim].handle

            async def kill_engine() -> None:
                await asyncio.sleep(delay)
                tree = await handle.process_cpus.remote()
                pids = [pid for pid, (name, _) in tree.items() if "EngineCore" in name]
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                _event(events, engine_step=version, what=f"replica {victim}'s engine core "
                       f"(pids {pids}) SIGKILLed {delay:.2f} s after the sync of v{version}, "
                       "its actor alive")  # fmt: skip

            tasks.append(asyncio.ensure_future(kill_engine()))
        if version in rank_at and groups and groups[-1].pids:
            delay = rank_at.pop(version)
            group = groups[-1]

            def kill_rank() -> None:
                try:
                    os.kill(group.pids[0], signal.SIGKILL)
                except ProcessLookupError:  # the group ended meanwhile: a later attempt's
                    rank_at[version] = delay
                    return
                _event(events, rank_step=version, what=f"trainer rank 0 (pid {group.pids[0]}) "
                       f"SIGKILLed {delay:.2f} s after the sync of v{version}")  # fmt: skip

            asyncio.get_running_loop().call_later(delay, kill_rank)
        for step in sorted(x for x in fixed_at if x <= version):  # opd syncs every 2 steps
            kill_fixed(step, version)
        return result

    async def kill_hybrids(hybrids: dict) -> None:
        """At each planned step's validation, kill the hybrid replica while a validation
        request is leased to it (awake, not paused, a request in flight)."""
        while hybrid_at and hybrids:
            step = hybrid_at[0]
            sid = sorted(hybrids)[0]
            while validating.get("version", 0) < step:
                await asyncio.sleep(0.05)
            try:
                status = await hybrids[sid].status()
            except Exception:
                return  # gone already
            if validating["version"] > step:
                hybrid_at.pop(0)  # the run passed that validation without us seeing it
                continue
            if not status["paused"] and status["inflight"] > 0:
                await asyncio.to_thread(ray.kill, hybrids[sid].handle)
                _event(events, hybrid_step=hybrid_at.pop(0),
                       what=f"hybrid replica {sid} killed while validating at step {step}")  # fmt: skip
                hybrids = {k: v for k, v in hybrids.items() if k != sid}
            await asyncio.sleep(0.02)

    async def run_with_replicas(p_, servers, **kw):
        killer = asyncio.ensure_future(kill_hybrids(dict(kw.get("hybrids") or {})))
        try:
            return await real_with(p_, servers, **kw)
        finally:
            killer.cancel()

    def write(summary) -> None:
        led = summary["trainer"].buffer.core.prompts
        s = summary["prompts"]
        positions = [r.position for r in led.records()]
        Path(out_path).write_text(json.dumps({
            "steps": summary["steps"], "prompts": s,
            "duplicated": len(positions) - len(set(positions)),
            "lost": len(set(range(s["first_position"], s["next_position"])) - set(positions)),
            "removed": summary["removed_replicas"], "replaced": summary["replaced_replicas"],
            "hybrid_lost": summary["hybrid_lost"],
            "fixed": {f.kind: f.summary() for f in fixed},  # teachers' / judges' replicas
            "val": summary["val_history"],
        }))  # fmt: skip

    async def run_job(cfg):
        summary = await real_job(cfg)
        write(summary)
        return summary

    ReplicaPool.sync = sync
    TrainerGroup.start = classmethod(start_group)
    FixedReplicas.__init__ = fixed_init
    job_module.run_with_replicas = run_with_replicas
    # Every recipe's main imports it after this (opd and genrm: through their runners).
    job_module.run_job = run_job
    return cli_main(argv)


# ---- the soak --------------------------------------------------------------------------
class Load:
    """The 1-minute load average every 5 s while a run goes."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(5):
                return

    def stop(self) -> str:
        self._stop.set()
        s = self.samples
        return f"{min(s):.1f} / {statistics.median(s):.1f} / {max(s):.1f}"


def _steps_logged(metrics: Path, skip: int) -> list[int]:
    if not metrics.exists():
        return []
    lines = metrics.read_text().splitlines()[skip:]
    rows = [json.loads(x) for x in lines if '"reward/mean"' in x and x.endswith("}")]
    return [int(r["step"]) for r in rows]


def _group_left(pgid: int) -> list[str]:
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "-g", str(pgid)], capture_output=True, text=True
    )
    return [x.strip()[:80] for x in out.stdout.splitlines() if x.strip()]


def run_until_done(
    recipe: str, name: str, overrides: list[str], root: Path, p: dict, log: list[str]
):
    """Attempts of `offbeat run` until one ends; SIGKILL at each planned job kill.
    Returns the last run's ledger counts, the restarts, the wall time, the load."""
    exp = root / name
    exp.mkdir(parents=True, exist_ok=True)
    plan_path, out_path = exp / "plan.json", exp / "result.json"
    events = exp / "events.jsonl"
    plan_path.write_text(json.dumps({**p, "events": str(events)}))
    metrics = root / name / "metrics.jsonl"
    job_at = list(p["job"])
    t0, restarts, load = time.perf_counter(), 0, Load()
    auto = 0  # in-process restarts after a dead trainer rank (trainer.max_restarts)
    while True:
        argv = ["run", recipe, *overrides, f"trainer.resume={'true' if restarts else 'false'}"]
        attempt_log = exp / f"attempt-{restarts}.log"
        skip = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        with attempt_log.open("w") as f:
            proc = subprocess.Popen(
                [sys.executable, __file__, "child", str(plan_path), str(out_path), *argv],
                stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        killed_at = None
        while proc.poll() is None:
            time.sleep(0.1)
            if job_at and job_at[0][0] in _steps_logged(metrics, skip):
                step, delay = job_at.pop(0)
                time.sleep(delay)
                os.kill(proc.pid, signal.SIGKILL)
                killed_at = step
                _event(events, job_step=step,
                       what=f"job process SIGKILLed {delay:.2f} s after step {step} was logged")  # fmt: skip
        proc.wait()
        said = [x.strip() for x in attempt_log.read_text().splitlines()
                if "resumed from" in x or "removed" in x or "replacement" in x
                or "(trainer.max_restarts)" in x]  # fmt: skip
        log.extend(f"  [{name} attempt {restarts}] said: {x[:200]}" for x in said)
        auto += sum("(trainer.max_restarts)" in x for x in said)
        if killed_at is None:
            if proc.returncode != 0:
                raise SystemExit(f"{name}: attempt {restarts} failed (rc {proc.returncode}); "
                                 f"see {attempt_log}")  # fmt: skip
            break
        # What outlived the job's process (Ray's reaper and vLLM's PDEATHSIG stop the
        # rest); after 30 s, this script stops what is left of its process group.
        deadline = time.monotonic() + 30
        while (left := _group_left(proc.pid)) and time.monotonic() < deadline:
            time.sleep(1)
        if left:
            log.append(f"  {len(left)} processes of the killed job outlived it by 30 s: {left}")
            os.killpg(proc.pid, signal.SIGKILL)
        restarts += 1
        log.append(f"  restart {restarts}: offbeat run {recipe} ... trainer.resume=true")
    wall = time.perf_counter() - t0
    for e in _fired(events):
        log.append(f"  [{name}] {e['what']}")
    result = {**json.loads(out_path.read_text()), "auto_restarts": auto}
    return result, restarts, wall, load.stop(), _fired(events)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.exit(child(sys.argv[2], sys.argv[3], sys.argv[4:]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--job-kills", type=int, default=2)
    ap.add_argument("--replica-kills", type=int, default=2)
    # --engine-kills, --rank-kills: 1 each for separate_async, 0 for opd / genrm (as their
    # recorded runs were made)
    ap.add_argument("--engine-kills", type=int, default=None, help="replica engine SIGKILLs")
    ap.add_argument("--hybrid-kills", type=int, default=1)
    ap.add_argument("--rank-kills", type=int, default=None, help="trainer rank SIGKILLs")
    ap.add_argument("--save-freq", type=int, default=5)
    ap.add_argument("--test-freq", type=int, default=10)
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument(
        "--recipe", default="separate_async", choices=["separate_async", "opd", "genrm"]
    )
    ap.add_argument("--teacher-kills", type=int, default=0, help="opd: teacher replica kills")
    ap.add_argument("--judge-kills", type=int, default=0, help="genrm: judge replica kills")
    args, extra = ap.parse_known_args()
    for kind in ("engine_kills", "rank_kills"):
        if getattr(args, kind) is None:
            setattr(args, kind, 1 if args.recipe == "separate_async" else 0)
    wrong = (args.teacher_kills and args.recipe != "opd") or (
        args.judge_kills and args.recipe != "genrm"
    )
    if wrong:
        ap.error("--teacher-kills needs --recipe opd, --judge-kills --recipe genrm")
    root = Path(tempfile.mkdtemp(prefix="chaos_soak-"))
    common = [
        f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.test_freq}",
        f"trainer.save_freq={args.save_freq}", f"trainer.log_dir={root}",
        "runtime.progress_bar=false", "trainer.loggers=[console,jsonl]",
        *(HYBRID if args.hybrid_kills else []), *extra,
    ]  # fmt: skip

    def named(name: str) -> list[str]:
        return [*common, f"trainer.experiment_name={name}",
                f"trainer.checkpoint_dir={root / 'ckpt' / name}"]  # fmt: skip

    print(f"load average at the start: {os.getloadavg()} on {os.cpu_count()} CPUs", flush=True)
    log: list[str] = []
    none = {"job": [], "replica": [], "hybrid": [], "fixed": [], "engine": [], "rank": []}
    base = None
    print(f"recipe {args.recipe}", flush=True)
    if not args.skip_baseline:
        base = run_until_done(args.recipe, "baseline", named("baseline"), root, none, log)
        print(f"baseline done in {base[2]:.0f} s", flush=True)
    p = plan(args)
    chaos = run_until_done(args.recipe, "chaos", named("chaos"), root, p, log)
    print("\n".join(log))

    def row(what: str, r, kills: dict) -> str:
        res, restarts, wall, load, _ = r
        q = res["prompts"]
        reasons = q["failed_by_reason"] or ""
        return (
            f"| {what} | {res['steps']} | {kills.get('job', 0)} | {kills.get('replica', 0)} | "
            f"{kills.get('engine', 0)} | {kills.get('hybrid', 0)} | {kills.get('fixed', 0)} | "
            f"{kills.get('rank', 0)} | {restarts} | {res['auto_restarts']} | {q['drawn']} | "
            f"{q['trained']} | "
            f"{q['evicted']} | {q['failed']} {reasons} | {q['in_flight']} | {res['lost']} | "
            f"{res['duplicated']} | {wall:.0f} | {load} |"
        )

    fired = chaos[4]
    kinds = ("job", "replica", "engine", "hybrid", "fixed", "rank")
    kills = {k: sum(f"{k}_step" in e for e in fired) for k in kinds}
    print(
        "\n| run | steps | job SIGKILLs | replica kills | engine kills | hybrid kills | "
        "teacher / judge kills | rank kills | job restarts | automatic restarts | prompts "
        "drawn | trained | evicted | failed | in flight | lost | duplicated | wall s | load "
        "min / median / max |\n|" + "---|" * 19
    )
    if base is not None:
        print(row("baseline (no kills)", base, {}))
    print(row("chaos", chaos, kills))
    q = chaos[0]["prompts"]
    ratio = f"{chaos[2] / base[2]:.2f}x the run without kills; " if base is not None else ""
    print(
        f"\noverhead {ratio}resumes {q['resumes']}, re-issued {q['reissued']}; replicas "
        f"removed {chaos[0]['removed']}, replaced {chaos[0]['replaced']}, hybrid lost "
        f"{chaos[0]['hybrid_lost']}; teachers / judges {chaos[0].get('fixed')}; validation "
        f"{chaos[0]['val']}; planned {p}"
    )
    print(f"load average at the end: {os.getloadavg()}; runs in {root}")


if __name__ == "__main__":
    main()

"""Chaos soak (first cut): the default job with kills at seeded random steps, every prompt
of the data order accounted for across the resumes, against the same job without kills.

Kills (each at a step drawn from `--seed`):
- trainer: the run dies after a step's update, before its weight sync (the step's work is
  lost, as in a crash); the job is started again with `trainer.resume=true` from the
  newest checkpoint (fresh replicas and trainer; Ray stays up), automatically;
- replica: a rollout replica's actor is killed (`ray.kill`, its engine with it) a seeded
  fraction of a second after a weight sync, mid-generation; the job replaces it.
Not covered yet: hybrid replicas, OPD teachers, GenRM judges, a trainer rank of a
multi-rank group (issue 31 item 3).

Prints the kills survived, prompts lost and duplicated (from the resumed run's prompt
ledger, which raises on either), the ledger's counts, and the wall time against the same
job without kills, from the same invocation.

    uv run --frozen --no-sync python benchmarks/chaos_soak.py [--steps 100] [--seed 0]
        [--trainer-kills 2] [--replica-kills 2] [--save-freq 5] [key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from pathlib import Path


class Killed(Exception):
    """The trainer died mid-step."""


def plan(steps: int, seed: int, trainer_kills: int, replica_kills: int) -> tuple[list, list]:
    rng = random.Random(seed)
    trainer = sorted(rng.sample(range(2, steps), trainer_kills))
    replica = sorted(
        (s, rng.uniform(0.05, 1.0)) for s in rng.sample(range(1, steps), replica_kills)
    )
    return trainer, replica


def patch_kills(trainer_at: list[int], replica_at: list[tuple[int, float]], log: list[str]):
    """Make ReplicaPool.sync kill as planned; each kill fires once over every attempt."""
    import ray

    from offbeat.core.trainer.replicas import ReplicaPool

    real_sync = ReplicaPool.sync
    pending_trainer, pending_replica = list(trainer_at), dict(replica_at)

    async def sync(self, named_tensors, version):
        if version in pending_trainer:
            pending_trainer.remove(version)
            log.append(f"trainer killed at step {version} (after its update, before its sync)")
            raise Killed(f"step {version}")
        result = await real_sync(self, named_tensors, version)
        if version in pending_replica and self.servers:
            delay = pending_replica.pop(version)
            victim = sorted(self.servers)[0]
            handle = self.servers[victim].handle

            def kill() -> None:
                ray.kill(handle)
                log.append(f"replica {victim} killed {delay:.2f}s after the sync of v{version}")

            asyncio.get_running_loop().call_later(delay, kill)
        return result

    ReplicaPool.sync = sync
    return lambda: setattr(ReplicaPool, "sync", real_sync)


def job(overrides: list[str]):
    from offbeat.core.cli import load_recipe_config

    return load_recipe_config("separate_async", ["runtime.progress_bar=false", *overrides])


def run_until_done(overrides: list[str], log: list[str]) -> tuple[dict, int, float]:
    """Run the job, restarting it with trainer.resume=true after each trainer kill.
    Returns the last run's summary, the restarts, the wall time of all attempts."""
    t0, restarts = time.perf_counter(), 0
    while True:
        module, cfg = job([*overrides, f"trainer.resume={'true' if restarts else 'false'}"])
        try:
            summary = asyncio.run(module.run_job(cfg))
            return summary, restarts, time.perf_counter() - t0
        except Killed:
            restarts += 1
            log.append(f"restart {restarts}: resuming from the newest checkpoint")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trainer-kills", type=int, default=2)
    ap.add_argument("--replica-kills", type=int, default=2)
    ap.add_argument("--save-freq", type=int, default=5)
    args, extra = ap.parse_known_args()
    root = Path(tempfile.mkdtemp(prefix="chaos_soak-"))
    common = [f"trainer.total_training_steps={args.steps}", *extra]

    def named(name: str) -> list[str]:
        return [
            *common, f"trainer.log_dir={root}", f"trainer.experiment_name={name}",
            f"trainer.checkpoint_dir={root / 'ckpt' / name}", f"trainer.save_freq={args.save_freq}",
        ]  # fmt: skip

    base_log: list[str] = []
    base, _, base_s = run_until_done(named("baseline"), base_log)

    trainer_at, replica_at = plan(args.steps, args.seed, args.trainer_kills, args.replica_kills)
    log: list[str] = []
    undo = patch_kills(trainer_at, replica_at, log)
    try:
        chaos, restarts, chaos_s = run_until_done(named("chaos"), log)
    finally:
        undo()
    p = chaos["prompts"]  # the run's end already checked the ledger (it raises on a loss)
    led = chaos["trainer"].buffer.core.prompts
    positions = [r.position for r in led.records()]
    duplicated = len(positions) - len(set(positions))
    lost = len(set(range(p["first_position"], p["next_position"])) - set(positions))
    print("\n".join(log))
    print(
        f"\n| run | steps | trainer kills | replica kills | restarts | prompts "
        f"drawn | trained | evicted | failed | in flight | lost | duplicated | wall s |\n"
        f"|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        f"| baseline (no kills) | {base['steps']} | 0 | 0 | 0 | {base['prompts']['drawn']} | "
        f"{base['prompts']['trained']} | {base['prompts']['evicted']} | "
        f"{base['prompts']['failed']} | {base['prompts']['in_flight']} | 0 | 0 | {base_s:.0f} |\n"
        f"| chaos | {chaos['steps']} | {len(trainer_at)} | "
        f"{sum(x.startswith('replica') for x in log)} | "
        f"{restarts} | {p['drawn']} | {p['trained']} | {p['evicted']} | {p['failed']} "
        f"{p['failed_by_reason'] or ''} | {p['in_flight']} | {lost} | {duplicated} | "
        f"{chaos_s:.0f} |"
    )
    print(
        f"\noverhead {chaos_s / base_s:.2f}x the run without kills (restarts start the "
        f"replicas and the trainer again); resumes {p['resumes']}, re-issued {p['reissued']}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()

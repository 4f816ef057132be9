"""separate_async: asynchronous RL with rollout and training on separate resources.

    offbeat run separate_async [key=value ...]

What one run does (the pieces live in offbeat.core.trainer; this file only wires them):

    prompts (parquet) ─► RolloutDriver ─► SingleTurnAgentLoop ─► PartialRolloutClient
                              │                                        │ lease
                              ▼                                        ▼
                         ReplayBuffer ◄── trajectories + rewards   vLLM replicas (Ray actors)
                              │ oldest-first batch, span <= threshold   ▲
                              ▼                                        │ weights, every step
                         Trainer: advantages -> parameter_sync_step updates (FSDP2)
                                  -> CheckpointEngineManager.sync(version = step)

Rollout never stops for training: while the trainer updates, the replicas generate the
next batches on the previous weights (a sync interrupts them; the client resumes each
request on the new weights). `max_off_policy_threshold` bounds how old a trained sample
may be (`drop` evicts older ones and refills, `wait` holds training until stragglers end).
"""

from __future__ import annotations

import asyncio
from typing import Any

from offbeat.core.trainer.job import RunConfig, run_job

CONFIG = RunConfig  # the schema config.yaml and the overrides are loaded into
# Rollout replicas come from the `rollout.engine` registry entry (offbeat-rollout-vllm
# registers "vllm" through its entry point).


def report(summary: dict[str, Any]) -> None:
    counts = summary["counts"]
    val = summary["val_history"]
    print("\n=== separate_async finished ===")
    print(f"steps: {summary['steps']}  weight version: {summary['version']}")
    print(
        f"wall time: {summary['total_wall_s']:.0f}s (engines ready after {summary['startup_s']:.0f}s)"
    )
    if val:
        first, last = val[0], val[-1]
        best = max(val, key=lambda x: x[1])
        print(
            f"validation reward: {first[1]:.3f} (version {first[0]}) -> {last[1]:.3f} "
            f"(version {last[0]}), best {best[1]:.3f} (version {best[0]})"
        )
    print(
        f"prompts: submitted {counts['submitted']}, trained {counts['trained']}, evicted "
        f"{counts['evicted']}, failed {counts['failed']}, still in flight "
        f"{counts['pending'] + counts['running'] + counts['finished']}"
    )
    if summary.get("removed_replicas"):
        print(f"replicas removed: {summary['removed_replicas']}")
    print(f"metrics: {summary['metrics']}\nplot: {summary['plot']}")
    if summary.get("trace"):
        print(f"step timeline: {summary['trace']} (open in ui.perfetto.dev)")
    if summary.get("logs"):
        print(f"engine and Ray logs: {summary['logs']}/")


def main(cfg: RunConfig) -> int:
    summary = asyncio.run(run_job(cfg))
    report(summary)
    return 0


if __name__ == "__main__":
    import sys

    from offbeat.core.cli import main as cli_main

    sys.exit(cli_main(["run", "separate_async", *sys.argv[1:]]))

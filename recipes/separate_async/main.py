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

from offbeat.core.config.run import RunConfig
from offbeat.core.trainer.job import run_job
from offbeat.core.trainer.report import print_report
from offbeat.core.trainer.restart import run_with_restarts

CONFIG = RunConfig  # the schema config.yaml and the overrides are loaded into
# Rollout replicas come from the `rollout.engine` registry entry (offbeat-rollout-vllm
# registers "vllm" through its entry point).


def report(summary: dict[str, Any]) -> None:
    print_report(summary, "separate_async")


def main(cfg: RunConfig) -> int:
    summary = asyncio.run(run_with_restarts(run_job, cfg))
    report(summary)
    return 0


if __name__ == "__main__":
    import sys

    from offbeat.core.cli import main as cli_main

    sys.exit(cli_main(["run", "separate_async", *sys.argv[1:]]))

"""separate_async_vlm: separate_async GRPO on image prompts, through the model's processor.

    offbeat run separate_async_vlm [key=value ...]

The same job as separate_async; what differs is in the data and the model:

    rows (prompt with {"type": "image"} parts + images column)
        ─► SingleTurnAgentLoop with the model's AutoProcessor: prompt ids (each image's
           placeholder widened), pixel_values / image_grid_thw, PNG bytes
        ─► vLLM replica: the ids + multi_modal_data (the images)
        ─► trajectories carry the vision inputs ─► FSDP2 forward with them

The default model, offbeat-tiny-vl, is a tiny Qwen2-VL built locally and warm-started on
the synthetic visual task (offbeat.core.tasks.visual); RL then raises the validation reward.
"""

from __future__ import annotations

import asyncio
from typing import Any

from offbeat.core.config.run import RunConfig
from offbeat.core.trainer.job import run_job
from offbeat.core.trainer.report import print_report
from offbeat.core.trainer.restart import run_with_restarts

CONFIG = RunConfig  # the schema config.yaml and the overrides are loaded into


def report(summary: dict[str, Any]) -> None:
    print_report(summary, "separate_async_vlm")


def main(cfg: RunConfig) -> int:
    summary = asyncio.run(run_with_restarts(run_job, cfg))
    report(summary)
    return 0


if __name__ == "__main__":
    import sys

    from offbeat.core.cli import main as cli_main

    sys.exit(cli_main(["run", "separate_async_vlm", *sys.argv[1:]]))

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

from offbeat.core.trainer.job import RunConfig, run_job

CONFIG = RunConfig  # the schema config.yaml and the overrides are loaded into


def report(summary: dict[str, Any]) -> None:
    val, counts = summary["val_history"], summary["counts"]
    print("\n=== separate_async_vlm finished ===")
    print(f"steps: {summary['steps']}  weight version: {summary['version']}")
    print(
        f"wall time: {summary['total_wall_s']:.0f}s (engines ready after {summary['startup_s']:.0f}s)"
    )
    if val:
        (v0, r0), (v1, r1) = val[0], val[-1]
        best = max(val, key=lambda x: x[1])
        print(f"validation reward: {r0:.3f} (version {v0}) -> {r1:.3f} (version {v1}), "
              f"best {best[1]:.3f} (version {best[0]})")  # fmt: skip
    print(f"prompts: submitted {counts['submitted']}, trained {counts['trained']}, "
          f"evicted {counts['evicted']}, failed {counts['failed']}")  # fmt: skip
    print(f"metrics: {summary['metrics']}")


def main(cfg: RunConfig) -> int:
    summary = asyncio.run(run_job(cfg))
    report(summary)
    return 0


if __name__ == "__main__":
    import sys

    from offbeat.core.cli import main as cli_main

    sys.exit(cli_main(["run", "separate_async_vlm", *sys.argv[1:]]))

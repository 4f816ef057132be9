"""What a job is given before anything starts: the seeds, the dataset files (a synthetic
task written when none are configured), the model resolved to a local directory (and
warm-started when it is one of offbeat's tiny models), and the step count
`trainer.total_epochs` leaves; and the run's first log line.

Knows the config, the task writers and the model registry; not Ray, the replicas or the
loop.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from offbeat.core.config.run import RunConfig
from offbeat.core.models.resolve import resolve_model
from offbeat.core.models.tiny import TINY_PREFIX

__all__ = ["Prepared", "prepare", "resolve_data", "run_header", "wants_warm_start"]


def wants_warm_start(cfg: RunConfig) -> bool:
    """`warm_start.enabled` null (auto): only offbeat's own tiny models; true/false: as said."""
    ws = cfg.warm_start
    if ws.steps <= 0 or ws.enabled is False:
        return False
    return (
        ws.enabled is True or cfg.model.path.startswith(TINY_PREFIX) or _is_tiny_vlm(cfg.model.path)
    )


def _is_tiny_vlm(path: str) -> bool:
    from offbeat.core.models.tiny_vlm import TINY_VLM_PREFIX

    return path == TINY_VLM_PREFIX


def resolve_data(cfg: RunConfig, out_dir: Path) -> tuple[list[str], list[str]]:
    """The dataset files; a synthetic task is written when none are configured."""
    train, val = list(cfg.data.train_files), list(cfg.data.val_files)
    if train:
        return train, val
    from offbeat.core.tasks import write_task_files

    t = cfg.task
    d = Path(t.out_dir) if t.out_dir else out_dir / f"{t.name}-{t.seed}-{t.min_len}-{t.max_len}"
    if t.name == "shapes":  # the visual task: images of squares, count or colour
        from offbeat.core.tasks.visual import write_visual_task_files

        tr, va = write_visual_task_files(d, n_train=t.n_train, n_val=t.n_val, seed=t.seed)
        return [str(tr)], val or [str(va)]
    tr, va = write_task_files(
        d,
        t.name,
        n_train=t.n_train,
        n_val=t.n_val,
        seed=t.seed,
        min_len=t.min_len,
        max_len=t.max_len,
    )
    return [str(tr)], val or [str(va)]


@dataclass
class Prepared:
    """A config whose model path and dataset files are resolved to local files."""

    cfg: RunConfig
    model_dir: Path
    train_files: list[str]
    val_files: list[str]
    setup_s: float
    notes: list[str] = field(default_factory=list)  # what prepare decided, for the log
    model_spec: str = ""  # model.path as configured (e.g. offbeat-tiny:tiny), before resolving


def prepare(cfg: RunConfig) -> Prepared:
    """Seeds, threads, the synthetic dataset, the (tiny, warm-started) model, and the step
    count `trainer.total_epochs` leaves."""
    from offbeat.core.tasks import read_parquet
    from offbeat.core.tasks.dataloader import count_rows, steps_within_epochs
    from offbeat.core.trainer.warm_start import warm_start

    t0 = time.perf_counter()
    seed = cfg.trainer.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(cfg.runtime.trainer_threads)
    from offbeat.core.models import cache_root

    cache_dir = cache_root()
    train_files, val_files = resolve_data(cfg, cache_dir / "tasks")
    model_dir = resolve_model(cfg.model.path, cache_dir / "models")
    notes = []
    if wants_warm_start(cfg):
        rows = [r for f in train_files for r in read_parquet(f)]
        model_dir = warm_start(
            model_dir, rows, cfg.warm_start, cache_dir=cache_dir / "warm_start",
            prompt_key=cfg.data.prompt_key, override_config=cfg.model.override_config,
        )  # fmt: skip
    elif cfg.warm_start.steps > 0 and cfg.warm_start.enabled is None:
        notes.append("no warm start (offbeat-tiny models only; warm_start.enabled=true)")
    t = cfg.trainer
    steps = steps_within_epochs(
        t.total_training_steps, t.total_epochs, count_rows(train_files), cfg.data.train_batch_size
    )
    if steps != t.total_training_steps:
        notes.append(f"trainer.total_epochs={t.total_epochs} leaves {steps} steps")
    job = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=str(model_dir)),
        trainer=dataclasses.replace(t, total_training_steps=steps),
    )
    return Prepared(
        job, model_dir, train_files, val_files, time.perf_counter() - t0, notes, cfg.model.path
    )


def run_header(p: Prepared, replicas: int, ready_s: float) -> str:
    """The run's first log line: its name (trainer.project_name/experiment_name) and what
    `prepare` decided."""
    t = p.cfg.trainer
    return (
        f"offbeat: run {t.project_name}/{t.experiment_name} mode={t.mode} "
        f"steps={t.total_training_steps} replicas={replicas} model={p.model_dir} "
        f"setup={p.setup_s:.1f}s replicas_ready={ready_s:.1f}s"
    ) + "".join(f"; {n}" for n in p.notes)

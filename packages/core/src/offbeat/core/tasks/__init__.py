"""Synthetic tasks with checkable answers and the parquet prompt dataloader."""

from offbeat.core.tasks.dataloader import PromptDataLoader
from offbeat.core.tasks.synthetic import (
    ALPHABET,
    TASKS,
    SyntheticTaskConfig,
    make_rows,
    read_parquet,
    write_parquet,
    write_task_files,
)

__all__ = [  # synthetic tasks and the parquet loader
    "ALPHABET",
    "TASKS",
    "PromptDataLoader",
    "SyntheticTaskConfig",
    "make_rows",
    "read_parquet",
    "write_parquet",
    "write_task_files",
]

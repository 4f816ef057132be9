"""The dataset row format, synthetic tasks with checkable answers and the parquet prompt
dataloader."""

from offbeat.core.tasks.dataloader import PromptDataLoader
from offbeat.core.tasks.rows import (
    data_source_counts,
    parquet_columns,
    reward_fields,
    row_extra_info,
    row_ground_truth,
    row_messages,
)
from offbeat.core.tasks.synthetic import (
    ALPHABET,
    TASKS,
    SyntheticTaskConfig,
    make_rows,
    read_parquet,
    write_parquet,
    write_task_files,
)

__all__ = [  # noqa: RUF022 (grouped by concept)
    # synthetic tasks and the parquet loader
    "ALPHABET",
    "TASKS",
    "PromptDataLoader",
    "SyntheticTaskConfig",
    "make_rows",
    "read_parquet",
    "write_parquet",
    "write_task_files",
    # the row format (offbeat's and verl's)
    "data_source_counts",
    "parquet_columns",
    "reward_fields",
    "row_extra_info",
    "row_ground_truth",
    "row_messages",
]

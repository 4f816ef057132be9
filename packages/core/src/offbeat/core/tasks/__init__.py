"""The dataset row format, synthetic tasks with checkable answers and the parquet prompt
dataloader; what makes a dataset file or row unusable (`bad_rows`)."""

from offbeat.core.tasks.bad_rows import (
    BAD_ROW,
    DatasetFileError,
    open_parquet,
    read_rows,
    row_problem,
    scan_file,
)
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
    # files and rows that cannot be used
    "BAD_ROW",
    "DatasetFileError",
    "open_parquet",
    "read_rows",
    "row_problem",
    "scan_file",
]

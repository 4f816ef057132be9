"""The dataset row format: where a row keeps its prompt, data_source, ground truth,
extra_info and sampling overrides.

Knows nothing about tokenizers, rewards or engines. Two layouts read the same way:
offbeat's (a top-level `ground_truth`) and verl's (`reward_model.ground_truth`, an
`extra_info` struct, an `ability` column that nothing reads). Columns:

- `prompt` (`data.prompt_key`): a string (one user message) or a list of chat messages
  `{"role", "content"}`.
- `data_source`: the name of the reward function that scores the row (reward.name=task).
- `ground_truth`, else `reward_model.ground_truth`: passed to the reward function as is.
- `extra_info` (optional): a dict passed to the reward function as `extra_info=`.
- `sampling` (optional): per-row sampling overrides (e.g. `max_tokens`); a null field
  means "not set".
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "data_source_counts",
    "parquet_columns",
    "reward_fields",
    "row_extra_info",
    "row_ground_truth",
    "row_messages",
]


def row_messages(row: Mapping[str, Any], prompt_key: str = "prompt") -> list[dict[str, str]]:
    """The row's prompt as chat messages (a plain string is one user message)."""
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def row_ground_truth(row: Mapping[str, Any]) -> Any:
    """`ground_truth`, else verl's `reward_model.ground_truth`, else None."""
    truth = row.get("ground_truth")
    if truth is None:
        reward_model = row.get("reward_model")
        if isinstance(reward_model, Mapping):
            truth = reward_model.get("ground_truth")
    return truth


def row_extra_info(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's `extra_info` dict (`{}` when absent or null)."""
    extra = row.get("extra_info")
    return dict(extra) if isinstance(extra, Mapping) else {}


def reward_fields(row: Mapping[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    """(data_source, ground truth, extra_info): what a reward function needs of a row."""
    return row.get("data_source") or "", row_ground_truth(row), row_extra_info(row)


def parquet_columns(path: str | Path) -> list[str]:
    """The top-level column names of a parquet file (reads the footer only)."""
    import pyarrow.parquet as pq

    return list(pq.read_schema(path).names)


def data_source_counts(path: str | Path) -> dict[str, int] | None:
    """data_source -> number of rows in a parquet file, reading that column alone; None
    when the file has no `data_source` column. A null data_source counts as ""."""
    import pyarrow.parquet as pq

    if "data_source" not in parquet_columns(path):
        return None
    column = pq.read_table(path, columns=["data_source"]).column("data_source")
    counts: dict[str, int] = {}
    for item in column.value_counts().to_pylist():
        name = item["values"] if item["values"] is not None else ""
        counts[str(name)] = counts.get(str(name), 0) + int(item["counts"])
    return counts

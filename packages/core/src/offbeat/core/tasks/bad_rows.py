"""Dataset files and rows that cannot be trained on: what is wrong, in which file, at which row.

Knows the row format (`rows`) and parquet, nothing of tokenizers, rewards or runs. Two
kinds of problem, two answers:

- a *file* that is not parquet, is truncated or is empty (0 bytes) cannot be read at all:
  `open_parquet` / `read_rows` raise `DatasetFileError` naming the file and the reason,
  and `offbeat check` rejects it (as it does a parquet file of 0 rows);
- a *row* that cannot be a prompt (`row_problem`: a null prompt, a chat message without
  `content` or `role`, a prompt that is not valid UTF-8, a missing or undecodable image or
  as many images as the prompt's placeholders (`images`), a null ground truth where the
  file has a ground-truth column): `offbeat check` names the first ones with file and row
  index; a run that draws one anyway counts its group failed (reason `bad_row`) instead of
  crashing. Bytes that do not decode as UTF-8 (including UTF-16 surrogates written as
  CESU-8) lose the row's data when read: `read_rows` keeps its place with a row holding
  `BAD_ROW` (file, row index and why) and whatever columns did decode.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offbeat.core.tasks.images import image_problem
from offbeat.core.tasks.rows import row_ground_truth

__all__ = [
    "BAD_ROW",
    "DatasetFileError",
    "FileScan",
    "open_parquet",
    "read_rows",
    "row_problem",
    "scan_file",
]

log = logging.getLogger(__name__)

BAD_ROW = "_offbeat_bad_row"  # a row's key holding why it cannot be used (set on read)
_BATCH_ROWS = 8192


class DatasetFileError(ValueError):
    """A dataset file cannot be read (not parquet, truncated, empty, unreadable): `path`
    and `why`."""

    def __init__(self, path: str | Path, why: str) -> None:
        super().__init__(f"dataset file {str(path)!r}: {why}")
        self.path = str(path)
        self.why = why


def open_parquet(path: str | Path) -> Any:
    """`pyarrow.parquet.ParquetFile(path)`; raises `DatasetFileError` naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise DatasetFileError(p, "it does not exist")
    if p.stat().st_size == 0:
        raise DatasetFileError(p, "it is empty (0 bytes), not parquet")
    try:
        return pq.ParquetFile(p)
    except (OSError, pa.ArrowException) as e:
        raise DatasetFileError(
            p, f"it is not parquet, or truncated ({type(e).__name__}: {e})"
        ) from e


def _utf8_problem(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate {text[e.start : e.end]!r} at character {e.start}"
    return None


def row_problem(
    row: Mapping[str, Any], prompt_key: str = "prompt", *, needs_ground_truth: bool = True
) -> str | None:
    """Why `row` cannot be made a prompt and scored, or None. `needs_ground_truth`: a null
    ground truth is a problem where the row has a ground-truth column (`ground_truth`, or
    verl's `reward_model`) at all."""
    if BAD_ROW in row:
        return str(row[BAD_ROW])
    if prompt_key not in row:
        return f"no {prompt_key!r} column (data.prompt_key)"
    prompt = row[prompt_key]
    if prompt is None:
        return f"{prompt_key!r} is null"
    if isinstance(prompt, str):
        if bad := _utf8_problem(prompt):
            return f"{prompt_key!r} is not valid UTF-8 ({bad})"
    elif isinstance(prompt, list | tuple):
        if not prompt:
            return f"{prompt_key!r} is an empty list of chat messages"
        for j, m in enumerate(prompt):
            if not isinstance(m, Mapping):
                return f"{prompt_key!r} message {j} is a {type(m).__name__}, not a chat message"
            if m.get("role") is None:
                return f"{prompt_key!r} message {j} has no 'role'"
            content = m.get("content")
            if content is None:
                return f"{prompt_key!r} message {j} (role {m['role']!r}) has no 'content'"
            if isinstance(content, str) and (bad := _utf8_problem(content)):
                return f"{prompt_key!r} message {j} is not valid UTF-8 ({bad})"
    else:
        return (
            f"{prompt_key!r} is a {type(prompt).__name__}, not a string or a list of chat messages"
        )
    if bad := image_problem(row, prompt_key):
        return bad
    has_truth_column = "ground_truth" in row or "reward_model" in row
    if needs_ground_truth and has_truth_column and row_ground_truth(row) is None:
        return "the ground truth is null (ground_truth / reward_model.ground_truth)"
    return None


def _undecodable(batch: Any, i: int) -> tuple[str, dict[str, Any]]:
    """(which column of row `i` does not decode and why, the columns that do)."""
    problem, good = "it does not decode", {}
    for name in batch.schema.names:
        try:
            good[name] = batch.column(name)[i].as_py()
        except UnicodeDecodeError as e:
            at = bytes(e.object[e.start : e.start + 4])
            problem = f"column {name!r} is not valid UTF-8 ({e.reason} at byte {e.start}: {at!r})"
        except Exception as e:  # anything else arrow cannot turn into Python
            problem = f"column {name!r} does not decode ({type(e).__name__}: {e})"
    return problem, good


def _batch_rows(batch: Any, where: str, offset: int) -> list[dict[str, Any]]:
    """A record batch as row dicts; a row that does not decode becomes a `BAD_ROW` row."""
    try:
        return batch.to_pylist()
    except (UnicodeDecodeError, ValueError):
        pass
    rows = []
    for i in range(batch.num_rows):
        try:
            rows.append(batch.slice(i, 1).to_pylist()[0])
        except (UnicodeDecodeError, ValueError):
            problem, good = _undecodable(batch, i)
            rows.append({**good, BAD_ROW: f"{where} row {offset + i}: {problem}"})
    return rows


def _iter_rows(path: str | Path, limit: int | None = None):
    """(row index, row) of a parquet file, up to `limit` rows; `DatasetFileError` when a
    part of it cannot be read."""
    import pyarrow as pa

    pf = open_parquet(path)
    index = 0
    try:
        for batch in pf.iter_batches(batch_size=_BATCH_ROWS):
            for row in _batch_rows(batch, str(path), index):
                yield index, row
                index += 1
                if limit is not None and index >= limit:
                    return
    except (OSError, pa.ArrowException) as e:
        raise DatasetFileError(
            path,
            f"it cannot be read past row {index}, truncated or corrupt ({type(e).__name__}: {e})",
        ) from e


def read_rows(path: str | Path, *, prompt_key: str | None = None) -> list[dict[str, Any]]:
    """Every row of a parquet file. A row that does not decode is kept in place as a
    `BAD_ROW` row; with `prompt_key`, so is a row whose prompt `row_problem` rejects (the
    mark names the file and the row index). Raises `DatasetFileError`."""
    rows = []
    for i, row in _iter_rows(path):
        check = prompt_key is not None and BAD_ROW not in row
        if check and (problem := row_problem(row, prompt_key, needs_ground_truth=False)):
            row[BAD_ROW] = f"{path} row {i}: {problem}"
        rows.append(row)
    return rows


@dataclass
class FileScan:
    """What `scan_file` found: rows in the file, rows read, and the bad ones (index, why)."""

    num_rows: int
    rows_read: int
    bad: list[tuple[int, str]] = field(default_factory=list)
    bad_count: int = 0


def scan_file(
    path: str | Path,
    prompt_key: str = "prompt",
    *,
    needs_ground_truth: bool = True,
    limit: int | None = None,
    keep: int = 5,
) -> FileScan:
    """Check the first `limit` rows (None: all) of a parquet file with `row_problem`; keep
    the first `keep` bad ones. Raises `DatasetFileError`."""
    scan = FileScan(num_rows=open_parquet(path).metadata.num_rows, rows_read=0)
    for i, row in _iter_rows(path, limit):
        scan.rows_read = i + 1
        problem = row_problem(row, prompt_key, needs_ground_truth=needs_ground_truth)
        if problem is None:
            continue
        scan.bad_count += 1
        if len(scan.bad) < keep:
            prefix = f"{path} row {i}: "
            scan.bad.append((i, problem.removeprefix(prefix)))
    return scan

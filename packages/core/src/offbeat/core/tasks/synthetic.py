"""Synthetic tasks with checkable answers, generated from a fixed seed, written as parquet.

Knows nothing about tokenizers or models: a row is chat messages, a `data_source` that
names its reward function, and the ground truth. The tasks are small enough that a
character-level model of ~1M parameters learns them in minutes on a CPU:
- `reverse`: "reverse: bdca" -> "acdb"       (data_source "char_match", partial credit)
- `copy`:    "copy: bdca"    -> "bdca"       (data_source "char_match")
- `add`:     "add: 12+7"     -> "19"         (data_source "math")
- `mul`:     "mul: 37*58"    -> "2146"       (data_source "math"; `extra_info.expression`
  "37*58" is what a calculator tool is called on: the tool-use example's task, which a
  tiny model cannot do alone)
Rows may carry a `sampling` dict of per-prompt sampling overrides (e.g. `max_tokens`),
which benchmarks use to give responses a known length distribution.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

TASKS = ("reverse", "copy", "add", "mul")
_MIX = ("reverse", "copy", "add")  # what "mix" draws from (unchanged since it was written)
ALPHABET = "abcdef"


@dataclass
class SyntheticTaskConfig:
    """The synthetic task written when a job names no dataset files (`out_dir` empty:
    a cache directory keyed by these values)."""

    name: str = "reverse"
    n_train: int = 2000
    n_val: int = 64
    seed: int = 0
    min_len: int = 3
    max_len: int = 5
    out_dir: str = ""


def _letters(rng: random.Random, min_len: int, max_len: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(min_len, max_len)))


def _reverse(rng: random.Random, min_len: int, max_len: int) -> tuple[str, str, str]:
    s = _letters(rng, min_len, max_len)
    return f"reverse: {s}", s[::-1], "char_match"


def _copy(rng: random.Random, min_len: int, max_len: int) -> tuple[str, str, str]:
    s = _letters(rng, min_len, max_len)
    return f"copy: {s}", s, "char_match"


def _add(rng: random.Random, min_len: int, max_len: int) -> tuple[str, str, str]:
    hi = 10**max_len - 1
    a, b = rng.randint(0, hi), rng.randint(0, hi)
    return f"add: {a}+{b}", str(a + b), "math"


def _mul(rng: random.Random, min_len: int, max_len: int) -> tuple[str, str, str]:
    # Operands of min_len..max_len digits (no leading zeros).
    a, b = (rng.randint(10 ** (rng.randint(min_len, max_len) - 1), 10**max_len - 1) for _ in "ab")
    return f"mul: {a}*{b}", str(a * b), "math"


_MAKERS: dict[str, Callable[[random.Random, int, int], tuple[str, str, str]]] = {
    "reverse": _reverse,
    "copy": _copy,
    "add": _add,
    "mul": _mul,
}


def make_rows(
    task: str, n: int, *, seed: int = 0, min_len: int = 3, max_len: int = 5
) -> list[dict[str, Any]]:
    """`n` rows of `task` (or "mix" of all tasks), deterministic in `seed`."""
    if task != "mix" and task not in _MAKERS:
        raise ValueError(f"task={task!r}: expected one of {[*TASKS, 'mix']}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"task lengths: need 1 <= min_len ({min_len}) <= max_len ({max_len})")
    rng = random.Random(f"{task}:{seed}")
    rows = []
    for i in range(n):
        name = rng.choice(_MIX) if task == "mix" else task
        question, answer, source = _MAKERS[name](rng, min_len, max_len)
        row = {
            "prompt": [{"role": "user", "content": question}],
            "data_source": source,
            "ground_truth": answer,
            "index": i,
        }
        if name == "mul":
            row["extra_info"] = {"expression": question.split(": ", 1)[1]}
        rows.append(row)
    return rows


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write rows atomically (a temp file of this writer's own, then rename): concurrent
    writers of one path (test workers, a background build) never interleave their bytes."""
    import os
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a parquet file; one that does not decode is a `bad_rows.BAD_ROW` row
    (see `bad_rows.read_rows`). Raises `DatasetFileError` naming a file it cannot read."""
    from offbeat.core.tasks.bad_rows import read_rows

    return read_rows(path)


def _num_rows(path: Path) -> int | None:
    """Rows of an existing parquet file (from its footer), None when absent or unreadable."""
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, pa.ArrowException):
        return None


def write_task_files(
    out_dir: str | Path,
    task: str = "reverse",
    *,
    n_train: int = 2000,
    n_val: int = 64,
    seed: int = 0,
    min_len: int = 3,
    max_len: int = 5,
) -> tuple[Path, Path]:
    """Write `train.parquet` and `val.parquet` (disjoint seeds) into `out_dir`; return
    their paths. Existing files are reused when they hold the asked number of rows (rows
    are a function of task, seed and lengths: the caller keys `out_dir` by those), and
    rewritten otherwise, so a changed `n_train`/`n_val` is never silently ignored."""
    out = Path(out_dir)
    train, val = out / "train.parquet", out / "val.parquet"
    if _num_rows(train) != n_train:
        write_parquet(make_rows(task, n_train, seed=seed, min_len=min_len, max_len=max_len), train)
    if _num_rows(val) != n_val:
        rows = make_rows(task, n_val, seed=seed + 1_000_003, min_len=min_len, max_len=max_len)
        write_parquet(rows, val)
    return train, val

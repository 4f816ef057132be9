"""Config rules for rewards, run by `offbeat.core.config.validate` before anything starts:
`reward.timeout_s` is seconds > 0, every `reward.functions` entry imports, every dataset
file is readable parquet (not another format, not truncated, not 0 bytes), and every
`data_source` in the dataset files has a reward function.

Knows the config, the reward registry and the dataset files' footers and `data_source`
column (read alone: cheap even for large files); nothing of the running system. A
missing dataset file is reported by the job's own rule, not here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from offbeat.core.config.validation import Problems, check
from offbeat.core.registry import REWARD_FUNCTIONS
from offbeat.core.rewards.registry import BY_DATA_SOURCE, load_reward_fn

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

_FUNCTION_FORM = "'pkg.module:function' or 'path/to/file.py:function'"


def _user_functions(cfg: JobConfig, p: Problems) -> dict[str, bool]:
    """data_source -> whether its `reward.functions` entry imported (problems reported)."""
    out: dict[str, bool] = {}
    for source, path in dict(cfg.reward.functions or {}).items():
        key = f"reward.functions.{source}"
        if not isinstance(path, str) or not path.strip():
            p.add(key, path, f"a reward function path, {_FUNCTION_FORM}")
            out[str(source)] = False
            continue
        try:
            load_reward_fn(path)
            out[str(source)] = True
        except ValueError as e:
            p.add(key, path, f"an importable reward function ({e})")
            out[str(source)] = False
    return out


def _file_problem(cfg: JobConfig, path: str, known: set[str]) -> str | None:
    """What is wrong with one dataset file for this config, or None."""
    from offbeat.core.tasks.bad_rows import DatasetFileError, open_parquet
    from offbeat.core.tasks.rows import data_source_counts, parquet_columns

    try:
        open_parquet(path)
        columns = parquet_columns(path)
        counts = data_source_counts(path)
    except DatasetFileError as e:  # not parquet, truncated, empty
        return f"a readable parquet file; {Path(path).name}: {e.why}"
    except Exception as e:  # unreadable
        return f"a readable parquet file ({type(e).__name__}: {e})"
    prompt_key = cfg.data.prompt_key
    if prompt_key not in columns:
        return f"a {prompt_key!r} column (data.prompt_key); the file's columns: {columns}"
    if cfg.reward.name != BY_DATA_SOURCE:
        return None  # one scorer for every row
    registered = sorted(known)
    if counts is None:
        return (
            "a 'data_source' column: with reward.name=task each row is scored by its "
            f"data_source's reward function (registered: {registered}); or set reward.name "
            "to one scorer for every row"
        )
    missing = {s: n for s, n in sorted(counts.items()) if s not in known}
    if not missing:
        return None
    listed = ", ".join(f"{s!r} ({n} row{'s' if n != 1 else ''})" for s, n in missing.items())
    return (
        f"every data_source needs a reward function; none for {listed}; registered: "
        f"{registered}; map one with reward.functions.<data_source>='pkg.mod:fn', or set "
        "reward.name to one scorer for every row"
    )


@check
def _rewards(cfg: JobConfig, p: Problems) -> None:
    r = cfg.reward
    t = getattr(r, "timeout_s", None)
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < float("inf"):
        p.add(
            "reward.timeout_s",
            t,
            "seconds > 0 that one reward call may take (a call past it fails its group)",
        )
    user = _user_functions(cfg, p)
    if r.name != BY_DATA_SOURCE:
        if user:
            p.add(
                "reward.functions",
                dict(r.functions),
                f"unused with reward.name={r.name!r} (that one scorer scores every row); "
                "set reward.name=task to score each row by its data_source",
            )
        if r.name not in REWARD_FUNCTIONS:
            return  # reported by the registry rule
    # A failed import is reported above; its data_source counts as covered here.
    known = (set(REWARD_FUNCTIONS.names()) - {BY_DATA_SOURCE}) | set(user)
    for key in ("train_files", "val_files"):
        for f in getattr(cfg.data, key) or []:
            if not (isinstance(f, str) and Path(f).is_file()):
                continue
            if (problem := _file_problem(cfg, f, known)) is not None:
                p.add(f"data.{key}", f, problem)

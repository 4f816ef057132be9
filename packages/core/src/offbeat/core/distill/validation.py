"""Validation reward per task (per value of a row key, `data_source` by default), for the
student during training and for any other agent loop (a teacher's) at the end.

Knows nothing about training or engines: it runs one plain `Validator` per task over the
rows of that task and reports `val/reward` (all rows) plus `val/<task>/reward`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from offbeat.core.trainer.validation import Validator

__all__ = ["PerTaskValidator"]


class PerTaskValidator:
    """`run(tag)` -> `val/reward`, `val/<task>/reward`, `val/<task>/exact`; each result is
    also kept in `history`."""

    def __init__(
        self,
        agent: Any,
        rows: Sequence[Mapping[str, Any]],
        *,
        task_key: str = "data_source",
        max_concurrency: int = 64,
    ) -> None:
        by_task: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
        for row in rows:
            by_task[str(row.get(task_key))].append(row)
        if not by_task:
            raise ValueError("PerTaskValidator: no validation rows")
        self.tasks = {
            t: Validator(agent, r, max_concurrency=max_concurrency) for t, r in by_task.items()
        }
        self.history: list[dict[str, float]] = []

    async def run(self, tag: str = "val") -> dict[str, float]:
        out: dict[str, float] = {}
        total, count = 0.0, 0
        for task, v in self.tasks.items():
            m = await v.run(f"{tag}-{task}")
            out[f"val/{task}/reward"] = m["val/reward"]
            out[f"val/{task}/exact"] = m["val/exact"]
            total += m["val/reward"] * len(v.rows)
            count += len(v.rows)
        out["val/reward"] = total / count
        self.history.append(out)
        return out

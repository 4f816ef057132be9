"""An endless, shuffled stream of prompt rows from parquet files, with a resumable position.

Knows nothing about tokenizers or rollout: it hands out dataset rows (dicts). Each epoch
is a fresh permutation drawn from (seed, epoch), so the position (epoch, index) is all
the state needed to resume exactly where a run stopped. How many passes a run makes is
bounded by its step count (`steps_within_epochs`), not by the stream.

A file that cannot be read fails the constructor (`DatasetFileError`, naming the file); a
row that cannot be a prompt stays in the stream, marked (`bad_rows.BAD_ROW`: file, row
index, why), and the agent loop counts its group failed (reason `bad_row`).
"""

from __future__ import annotations

import logging
import random
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from offbeat.core.tasks.bad_rows import BAD_ROW, open_parquet, read_rows

__all__ = ["PromptDataLoader", "count_rows", "steps_within_epochs"]

log = logging.getLogger(__name__)


def count_rows(paths: Sequence[str | Path]) -> int:
    """Rows in the parquet files `paths` (read from their footers, not their data); raises
    `DatasetFileError` naming a file that cannot be read."""
    return sum(open_parquet(p).metadata.num_rows for p in paths)


def steps_within_epochs(
    total_training_steps: int, total_epochs: int | None, num_rows: int, train_batch_size: int
) -> int:
    """The steps a run makes: `total_training_steps`, cut to the whole batches that
    `total_epochs` passes over `num_rows` prompts hold (None: no cut). The loader itself
    stays endless: refills of evicted or failed prompts and the batches generated ahead
    may read a little past the last pass."""
    if total_epochs is None:
        return total_training_steps
    return min(total_training_steps, total_epochs * num_rows // train_batch_size)


class PromptDataLoader:
    """Rows of one or more parquet files, shuffled per epoch, consumed a few at a time.
    `prompt_key`: the prompt column (data.prompt_key), checked on every row at load."""

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        shuffle: bool = True,
        seed: int = 0,
        prompt_key: str = "prompt",
    ):
        if isinstance(paths, (str, Path)):
            paths = [paths]
        if not paths:
            raise ValueError("PromptDataLoader: no parquet files given")
        rows: list[dict[str, Any]] = []
        for p in paths:
            if not Path(p).is_file():
                raise FileNotFoundError(f"dataset file {str(p)!r} does not exist")
            file_rows = read_rows(p, prompt_key=prompt_key)
            bad = [r[BAD_ROW] for r in file_rows if BAD_ROW in r]
            if bad:
                log.warning(
                    "%d of %d rows of %s cannot be prompts; each group drawn from one fails "
                    "(reason bad_row). First: %s",
                    len(bad), len(file_rows), p, bad[0],
                )  # fmt: skip
            rows.extend(file_rows)
        if not rows:
            raise ValueError(f"dataset files {[str(p) for p in paths]} hold no rows")
        self.rows = rows
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        return len(self.rows)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    @property
    def stream_position(self) -> int:
        """How many rows the stream handed out: the next row's position in the data order
        (epoch × dataset size + index in the epoch's permutation)."""
        return self.epoch * len(self.rows) + self.index

    def next(self, n: int) -> list[dict[str, Any]]:
        """The next `n` rows (crossing epoch boundaries as needed)."""
        out = []
        for _ in range(n):
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            out.append(self.rows[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """The position and the shuffle's seed; the permutation of an epoch is drawn from
        (seed, epoch), so no RNG state is needed. `order_crc32` fingerprints the current
        epoch's permutation: a resume that would draw another order is refused."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "size": len(self.rows),
            "shuffle": self.shuffle,
            "order_crc32": _crc(self._order),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("size", len(self.rows)) != len(self.rows):
            raise ValueError(
                f"dataloader state is for {state['size']} rows but the dataset has "
                f"{len(self.rows)}: the dataset changed since the checkpoint"
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._order = self._permutation(self.epoch)
        if "order_crc32" in state and _crc(self._order) != state["order_crc32"]:
            raise ValueError(
                f"dataloader state: epoch {self.epoch}'s order (seed {self.seed}, shuffle "
                f"{self.shuffle}) is not the checkpoint's (shuffle {state.get('shuffle')}): "
                "resume with the data.shuffle the run was saved with"
            )


def _crc(order: list[int]) -> int:
    return zlib.crc32(",".join(map(str, order)).encode())

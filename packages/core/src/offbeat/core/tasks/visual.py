"""A seeded synthetic visual task: PIL-drawn squares, questions with exact answers.

Knows the row format (verl's, with an `images` column), nothing of models or engines.
Each image is a white square canvas cut into a 4x4 grid of cells; some cells hold a
filled square of one colour. A row asks either how many squares there are (answer "1".."4")
or what colour they are (answer "red", "green" or "blue"); `exact_match` scores it.
With 112-pixel images and Qwen2-VL's 28-pixel merged patches, each cell is one image
token. Rows are a function of the seed: the same seed writes the same files.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

from offbeat.core.tasks.synthetic import TASKS, make_rows, write_parquet

__all__ = [
    "COLOURS",
    "MIXABLE_TASKS",
    "QUESTIONS",
    "VISUAL_TASK",
    "make_visual_rows",
    "mixable_visual_rows",
    "task_rows",
    "visual_image",
    "write_visual_task_files",
]

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 30),
    "blue": (30, 30, 220),
}
QUESTIONS = {"count": "How many squares?", "colour": "What colour?"}
# The task's name where synthetic tasks are mixed (an OPD job's `distillation.tasks`), and
# the data_source its rows carry there: a teacher of that name takes them (scored by
# exact match, registered under this name in offbeat.core.rewards.scorers).
VISUAL_TASK = "shapes"
# The tasks a job may mix (an OPD job's `distillation.tasks`, a teacher's build).
MIXABLE_TASKS = (*TASKS, VISUAL_TASK)
_GRID = 4


def visual_image(cells: list[int], colour: str, size: int = 112) -> bytes:
    """PNG bytes of a `size` canvas with a filled square in each of `cells` (0..15)."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (size, size), (255, 255, 255))
    d = ImageDraw.Draw(im)
    cell = size // _GRID
    pad = max(1, cell // 6)
    for c in cells:
        x, y = (c % _GRID) * cell, (c // _GRID) * cell
        d.rectangle(
            [x + pad, y + pad, x + cell - pad - 1, y + cell - pad - 1], fill=COLOURS[colour]
        )
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def make_visual_rows(
    n: int, *, seed: int = 0, max_count: int = 4, size: int = 112
) -> list[dict[str, Any]]:
    """`n` rows: an image of 1..`max_count` squares and a count or colour question."""
    if not 1 <= max_count <= _GRID * _GRID:
        raise ValueError(f"make_visual_rows: max_count={max_count}: must be in 1..{_GRID**2}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.randint(1, max_count)
        colour = rng.choice(sorted(COLOURS))
        cells = rng.sample(range(_GRID * _GRID), k)
        kind = rng.choice(sorted(QUESTIONS))
        answer = str(k) if kind == "count" else colour
        parts = [{"type": "image", "text": None}, {"type": "text", "text": QUESTIONS[kind]}]
        rows.append(
            {
                "prompt": [{"role": "user", "content": parts}],
                "images": [{"bytes": visual_image(cells, colour, size), "path": None}],
                "data_source": "exact_match",
                "ground_truth": answer,
                "extra_info": {"question": kind},
            }
        )
    return rows


def mixable_visual_rows(n: int, *, seed: int = 0, size: int = 112) -> list[dict[str, Any]]:
    """`make_visual_rows` in the layout text rows share in one parquet file: the content a
    string with verl's `<image>` marker (not a list of parts), `data_source`
    `VISUAL_TASK`, and no `extra_info` (text rows have another one, or none). A text row
    mixed in beside them gets `images: []`."""
    from offbeat.core.tasks.images import IMAGE_PLACEHOLDER

    rows = make_visual_rows(n, seed=seed, size=size)
    for r in rows:
        (msg,) = r["prompt"]
        text = "".join(
            IMAGE_PLACEHOLDER if p["type"] == "image" else p["text"] for p in msg["content"]
        )
        r["prompt"] = [{"role": msg["role"], "content": text}]
        r["data_source"] = VISUAL_TASK
        del r["extra_info"]
    return rows


def task_rows(name: str, n: int, *, seed: int, min_len: int, max_len: int) -> list[dict[str, Any]]:
    """`n` rows of task `name` of `MIXABLE_TASKS`: a text task (`make_rows`) or the visual
    one in the layout that shares one parquet file with text rows (`mixable_visual_rows`)."""
    if name == VISUAL_TASK:
        return mixable_visual_rows(n, seed=seed)
    return make_rows(name, n, seed=seed, min_len=min_len, max_len=max_len)


def write_visual_task_files(
    out_dir: str | Path, *, n_train: int = 1000, n_val: int = 64, seed: int = 0, size: int = 112
) -> tuple[Path, Path]:
    """Write `train.parquet` and `val.parquet` (disjoint seeds) into `out_dir`, reusing
    files that hold the asked number of rows; return their paths."""
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n, s in (("train", n_train, seed), ("val", n_val, seed + 1_000_003)):
        path = out / f"{name}.parquet"
        if not (path.is_file() and pq.ParquetFile(path).metadata.num_rows == n):
            write_parquet(make_visual_rows(n, seed=s, size=size), path)
        paths.append(path)
    return paths[0], paths[1]

"""Rows with images (verl's layout): what `offbeat check`'s scan and the agent loop reject,
named by row, and how image parts are read."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from offbeat.core.tasks.bad_rows import row_problem, scan_file
from offbeat.core.tasks.images import content_parts, count_placeholders, decode_image


def _png(colour: str = "red", size: int = 28) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()


def _prompt(n_images: int, text: str = "how many squares?") -> list[dict]:
    parts = [{"type": "image", "text": None}] * n_images + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def test_image_parts_and_markers_are_counted_and_split_into_parts():
    msgs = [{"role": "user", "content": "<image>left <image> right"}]
    assert count_placeholders(msgs) == 2
    parts = content_parts(msgs)[0]["content"]
    assert parts == [
        {"type": "image"},
        {"type": "text", "text": "left "},
        {"type": "image"},
        {"type": "text", "text": " right"},
    ]
    # parquet's null field of a part struct is dropped, the image part kept in place
    assert content_parts(_prompt(1))[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "how many squares?"},
    ]


def test_an_image_is_read_from_bytes_a_path_or_a_struct(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(_png("blue"))
    for entry in (_png("blue"), str(path), {"bytes": None, "path": str(path)}):
        im = decode_image(entry)
        assert im.mode == "RGB" and im.getpixel((0, 0)) == (0, 0, 255)


def test_check_rejects_missing_undecodable_and_miscounted_images_naming_the_row(tmp_path):
    good = {"bytes": _png(), "path": None}
    rows = [
        {"prompt": _prompt(1), "images": [good]},  # 0: fine
        {"prompt": _prompt(1), "images": [{"bytes": None, "path": str(tmp_path / "no.png")}]},
        {"prompt": _prompt(1), "images": [{"bytes": b"not an image", "path": None}]},
        {"prompt": _prompt(2), "images": [good]},  # 3: two placeholders, one image
        {"prompt": _prompt(0), "images": [good]},  # 4: an image with no placeholder
        {"prompt": _prompt(2), "images": [good, good]},  # 5: fine
    ]
    path = tmp_path / "vis.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    scan = scan_file(path, needs_ground_truth=False)
    assert [i for i, _ in scan.bad] == [1, 2, 3, 4] and scan.bad_count == 4
    why = dict(scan.bad)
    assert "does not exist" in why[1] and "item 0" in why[1]
    assert "undecodable image" in why[2]
    assert "1 image(s)" in why[3] and "2 placeholder(s)" in why[3]
    assert "1 image(s)" in why[4] and "0 placeholder(s)" in why[4]


def test_a_text_row_has_no_image_problem():
    assert row_problem({"prompt": "2+2?"}) is None
    assert row_problem({"prompt": "see <image>"}) is not None  # a marker but no image


@pytest.mark.parametrize("entry", [None, b"", 3])
def test_a_null_empty_or_odd_image_entry_is_named(entry):
    problem = row_problem({"prompt": _prompt(1), "images": [entry]})
    assert problem is not None and "item 0" in problem

"""Rows with images, in verl's layout: an `images` column and chat content with image parts.

Knows the row format and how images are stored, nothing of processors, models or engines.
A row's `images` column is a list whose items are encoded image bytes, a path to an image
file, or a `{"bytes": ..., "path": ...}` struct (what Hugging Face datasets write for an
`Image` feature). The prompt marks where each image goes, in order: a content part
`{"type": "image"}` in a list-style `content`, or an `<image>` in a string `content`
(verl's text layout). `image_problem` is what `offbeat check` and the agent loop reject a
row for: a missing or undecodable image, or as many images as placeholders.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "IMAGES_KEY",
    "IMAGE_PLACEHOLDER",
    "content_parts",
    "count_placeholders",
    "decode_image",
    "image_bytes",
    "image_problem",
    "row_images",
]

IMAGES_KEY = "images"
IMAGE_PLACEHOLDER = "<image>"  # verl's marker in a string content


def row_images(row: Mapping[str, Any]) -> list[Any]:
    """The row's `images` entries as stored (an absent or null column: none)."""
    images = row.get(IMAGES_KEY)
    if images is None:
        return []
    if isinstance(images, (str, bytes, Mapping)):
        return [images]
    return list(images)


def image_bytes(entry: Any) -> bytes:
    """The encoded bytes of one `images` entry (bytes, a path, or a {bytes, path} struct).
    Raises ValueError saying what is missing."""
    if isinstance(entry, Mapping):
        data, path = entry.get("bytes"), entry.get("path")
        if data:
            return bytes(data)
        if path:
            return image_bytes(str(path))
        raise ValueError("an image struct with neither 'bytes' nor 'path'")
    if isinstance(entry, (bytes, bytearray, memoryview)):
        if not entry:
            raise ValueError("empty image bytes")
        return bytes(entry)
    if isinstance(entry, (str, Path)):
        p = Path(entry)
        if not p.is_file():
            raise ValueError(f"image file {str(p)!r} does not exist")
        return p.read_bytes()
    if entry is None:
        raise ValueError("a null image")
    raise ValueError(f"an image given as {type(entry).__name__} (expected bytes or a path)")


def decode_image(entry: Any) -> Any:
    """One `images` entry as an RGB `PIL.Image` (fully loaded). Raises ValueError."""
    from PIL import Image, UnidentifiedImageError

    data = image_bytes(entry)
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"undecodable image ({len(data)} bytes: {e})") from e


def _string_placeholders(text: str) -> int:
    return text.count(IMAGE_PLACEHOLDER)


def count_placeholders(messages: Sequence[Mapping[str, Any]] | str) -> int:
    """How many images the prompt places: `{"type": "image"}` parts plus `<image>` markers."""
    if isinstance(messages, str):
        return _string_placeholders(messages)
    n = 0
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, str):
            n += _string_placeholders(content)
        elif isinstance(content, Sequence):
            for part in content:
                if isinstance(part, Mapping) and part.get("type") == "image":
                    n += 1
                elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    n += _string_placeholders(part["text"])
    return n


def content_parts(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages with every content as a list of `{"type": "text"}` / `{"type":
    "image"}` parts (a processor's chat template renders the image parts): string content
    is split at its `<image>` markers; parquet's null fields of a part struct are dropped."""
    out = []
    for m in messages:
        content = m.get("content")
        parts: list[dict[str, Any]] = []
        pieces = [content] if isinstance(content, str) else list(content or [])
        for piece in pieces:
            if isinstance(piece, Mapping) and piece.get("type") == "image":
                parts.append({"type": "image"})
                continue
            text = piece if isinstance(piece, str) else (piece or {}).get("text") or ""
            chunks = text.split(IMAGE_PLACEHOLDER)
            for k, chunk in enumerate(chunks):
                if k:
                    parts.append({"type": "image"})
                if chunk:
                    parts.append({"type": "text", "text": chunk})
        out.append({**m, "content": parts})
    return out


def image_problem(row: Mapping[str, Any], prompt_key: str = "prompt") -> str | None:
    """Why the row's images cannot go with its prompt, or None: an image that is missing
    (a null entry, a path that does not exist) or does not decode, or a number of images
    other than the prompt's placeholders. A row with neither images nor placeholders has
    no problem here."""
    prompt = row.get(prompt_key)
    if prompt is None:
        return None  # row_problem names that
    images = row_images(row)
    wanted = count_placeholders(prompt)
    for k, entry in enumerate(images):
        try:
            decode_image(entry)
        except ValueError as e:
            return f"{IMAGES_KEY!r} item {k}: {e}"
    if len(images) != wanted:
        return (
            f"{len(images)} image(s) in {IMAGES_KEY!r} but {wanted} placeholder(s) in "
            f"{prompt_key!r} ({{'type': 'image'}} parts or {IMAGE_PLACEHOLDER!r} markers)"
        )
    return None

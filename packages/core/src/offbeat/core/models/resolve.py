"""`model.path` to a model directory: the names offbeat builds locally (`offbeat-tiny:<size>`,
`offbeat-tiny-vl`) are built (or reused from the cache); anything else is a path."""

from __future__ import annotations

from pathlib import Path

from offbeat.core.models.tiny import TINY_PREFIX, build_tiny_model
from offbeat.core.models.tiny_vlm import TINY_VLM_PREFIX, build_tiny_vlm

__all__ = ["resolve_model"]


def resolve_model(path: str, cache_dir: Path) -> Path:
    """`offbeat-tiny:<size>` builds (or reuses) a tiny model, `offbeat-tiny-vl` the tiny
    vision-language model and its processor; anything else is a path."""
    if path.startswith(TINY_PREFIX):
        size = path[len(TINY_PREFIX) :]
        # Normal init: the warm start and RL train it (0.3 is for untrained demos).
        return build_tiny_model(cache_dir / f"tiny-{size}", size, initializer_range=0.02)
    if path == TINY_VLM_PREFIX:
        return build_tiny_vlm(cache_dir / "tiny-vl", initializer_range=0.02)
    return Path(path)

"""The cold build path, once: the default job's `prepare` from an empty cache.

Every other test reads the session's hermetic cache (the root conftest), which the first
test to need a build fills; this one proves the path a new user takes on a fresh machine:
an empty `OFFBEAT_CACHE_DIR` gets the task files, the tiny model and its warm start, all
under that directory, and a second `prepare` rebuilds nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_default_job_prepares_from_an_empty_cache_then_reuses_it(tmp_path, monkeypatch):
    from offbeat.core.cli import load_recipe_config
    from offbeat.core.trainer.prepare import prepare

    cache = tmp_path / "cache"
    monkeypatch.setenv("OFFBEAT_CACHE_DIR", str(cache))
    _, cfg = load_recipe_config("separate_async", [f"trainer.log_dir={tmp_path / 'logs'}"])
    assert cfg.data.train_files == [] and cfg.warm_start.steps > 0  # the embedded default

    first = prepare(cfg)
    # Everything the job needs was built, and under the empty cache only.
    assert first.model_dir.is_relative_to(cache / "warm_start"), first.model_dir
    assert (first.model_dir / "config.json").is_file()
    assert (first.model_dir / "model.safetensors").is_file()
    assert all(Path(f).is_relative_to(cache / "tasks") for f in first.train_files + first.val_files)
    assert any((cache / "models").iterdir())  # the tiny base model the warm start began from
    built = _files(cache)

    second = prepare(cfg)
    assert (second.model_dir, second.train_files, second.val_files) == (
        first.model_dir, first.train_files, first.val_files,
    )  # fmt: skip
    assert _files(cache) == built  # nothing rebuilt or rewritten

"""The READMEs' own-model example passes `offbeat check` as written.

The example is the fenced block after the marker comment in README.md and in
recipes/separate_async/README.md (the two must be the same command). Its model and data
paths are replaced by a local HF model directory and local parquet files; everything else
is checked as written. It needs CUDA: on a machine without it the only problems are the
CUDA ones, and with CUDA present (faked here: 8 visible devices) it is valid.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from offbeat.core.cli import load_recipe_config
from offbeat.core.config import ConfigError
from offbeat.core.models import build_tiny_model
from offbeat.core.tasks import write_task_files

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- own-model example:"
READMES = [ROOT / "README.md", ROOT / "recipes" / "separate_async" / "README.md"]


def example_command(readme: Path) -> list[str]:
    """The arguments of the first fenced block after the marker in `readme`."""
    text = readme.read_text()
    assert MARKER in text, f"{readme} lost its own-model example marker"
    block = re.search(r"```bash\n(.*?)```", text[text.index(MARKER) :], re.S)
    assert block is not None
    return shlex.split(block.group(1).replace("\\\n", " "))


def overrides_of(argv: list[str], local: dict[str, str]) -> list[str]:
    """The Hydra overrides of `./offbeat run separate_async ...`, with the keys in `local`
    set to local paths instead."""
    assert argv[:3] == ["./offbeat", "run", "separate_async"], argv
    out = []
    for item in argv[3:]:
        key = item.partition("=")[0]
        out.append(f"{key}={local[key]}" if key in local else item)
    assert set(local) <= {o.partition("=")[0] for o in argv[3:]}, "a path key vanished"
    return out


@pytest.fixture(scope="module")
def local_paths(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("own_model")
    model = build_tiny_model(tmp / "model")  # a HF model directory, as a user would have
    train, val = write_task_files(tmp / "data", "add", n_train=64, n_val=8, min_len=1, max_len=1)
    return {
        "model.path": str(model),
        "data.train_files": f"[{train}]",
        "data.val_files": f"[{val}]",
    }


def test_both_readmes_show_the_same_command():
    first, second = (example_command(r) for r in READMES)
    assert first == second


def test_the_example_needs_only_cuda_here(local_paths, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    overrides = overrides_of(example_command(READMES[0]), local_paths)
    with pytest.raises(ConfigError) as info:
        load_recipe_config("separate_async", overrides)
    assert [p.key for p in info.value.problems] == ["resources.device"], str(info.value)


def test_the_example_is_valid_on_a_cuda_machine(local_paths, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    overrides = overrides_of(example_command(READMES[0]), local_paths)
    _, cfg = load_recipe_config("separate_async", overrides)
    assert cfg.model.path == local_paths["model.path"]
    assert (cfg.resources.device, cfg.resources.rollout_devices) == ("cuda", 7)
    assert cfg.model.dtype == "bfloat16" and "dtype" not in cfg.rollout.engine_kwargs
    assert cfg.warm_start.enabled is None  # so no warm start: model.path is not offbeat-tiny

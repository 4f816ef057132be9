"""Checkpoints of a run: the train engine's state plus everything the trainer needs to
continue exactly (step, dataloader position, RNG, replay-buffer state).

Knows nothing about the engine's format (it calls `engine.save(dir)` / `engine.load(dir)`)
or what the trainer state holds. A checkpoint is written into a hidden temporary
directory, marked complete, then renamed into place (atomic on one filesystem), so a run
killed mid-save never leaves a checkpoint that looks complete; `latest()` picks the newest
complete one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from offbeat.core.config.schema import TrainerConfig

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_MARKER = "COMPLETE"
_STATE = "trainer_state.pt"
_ENGINE = "engine"


def _other_dir(name: str) -> str:
    if not name.isidentifier() or name == _ENGINE:
        raise ValueError(f"checkpoint: engine name {name!r} must be an identifier, not {_ENGINE!r}")
    return name


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class CheckpointManager:
    """`root/step_00000012/{engine/, [critic/,] trainer_state.pt, COMPLETE}`; keeps the newest
    `keep_last` complete checkpoints (0: keep all)."""

    def __init__(self, root: str | Path, *, keep_last: int = 2) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def complete(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / _MARKER).is_file():
                out.append((int(m.group(1)), p))
        return sorted(out)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def save(
        self, step: int, engine: Any, state: dict[str, Any], *, others: dict[str, Any] | None = None
    ) -> Path:
        """`others`: further engines saved beside the actor's, each in its own directory
        (e.g. {"critic": critic_engine} -> step_…/critic/)."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        engine.save(str(tmp / _ENGINE))
        for name, other in (others or {}).items():
            other.save(str(tmp / _other_dir(name)))
        torch.save(state, tmp / _STATE)
        (tmp / _MARKER).write_text(json.dumps({"step": step, "time": time.time()}) + "\n")
        if final.exists():  # re-saving a step after a resume: replace it
            old = self.root / f".{final.name}.old-{os.getpid()}"
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        self._prune()
        return final

    def load(
        self, path: str | Path, engine: Any, *, others: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        path = Path(path)
        if not (path / _MARKER).is_file():
            raise FileNotFoundError(f"checkpoint {str(path)!r} is not complete (no {_MARKER})")
        for name in others or {}:
            if not (path / _other_dir(name)).is_dir():
                raise FileNotFoundError(
                    f"checkpoint {str(path)!r} holds no {name} state: it was saved by a run "
                    f"without a {name}; resume it with the same algorithm settings"
                )
        engine.load(str(path / _ENGINE))
        for name, other in (others or {}).items():
            other.load(str(path / _other_dir(name)))
        return torch.load(path / _STATE, weights_only=False)

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for _, p in self.complete()[: -self.keep_last]:
            shutil.rmtree(p, ignore_errors=True)


def make_checkpoints(trainer: TrainerConfig, keep_last: int) -> CheckpointManager | None:
    """The run's checkpoints in `trainer.checkpoint_dir`, keeping the newest `keep_last`;
    None when the run neither writes (save_freq < 0) nor resumes from one."""
    if trainer.save_freq < 0 and not trainer.resume:
        return None
    return CheckpointManager(trainer.checkpoint_dir, keep_last=keep_last)

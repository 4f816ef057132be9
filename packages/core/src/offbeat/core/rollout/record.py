"""Record the batches a run trains on (`rollout.record`), to replay them in later runs.

`Recorder` is a trainer step hook: after each chosen global step it writes the batch the
trainer consumed (the padded `TrajectoryBatch`, before advantages: token ids, masks,
rollout log-probs, rewards, weight versions, group uids) and each row's data_source to
`<dir>/step_<N>.safetensors`, then rewrites `<dir>/manifest.json` to list it (the format:
`offbeat.core.rollout.recording`). The writes run in one background thread of their own,
in step order: never on the event loop, and the trainer does not wait for them; a failed
write is raised at the next step (or by `close()`, which waits for the last one).

Knows nothing about how a batch was made (live or replayed) or what the trainer does
with it; advantages and recomputed log-probs are not recorded (a replay recomputes them).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from offbeat.core.data import TrajectoryBatch
from offbeat.core.rollout.recording import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    RecordingError,
    RecordingMismatch,
    encode_step,
    group_runs,
    identity_mismatches,
    read_manifest,
    step_file,
    write_atomic,
)

__all__ = ["Recorder", "data_source_of"]

logger = logging.getLogger(__name__)


def data_source_of(row: Any) -> str:
    """The data_source of a prompt row ("" when it has none)."""
    if isinstance(row, Mapping):
        source = row.get("data_source")
        return "" if source is None else str(source)
    return ""


class Recorder:
    """Writes the trained batch of every `every`-th step, or of the steps in `steps`, to
    `directory`. `identity` (see `recording.run_identity`) and `config_sha256` go into the
    manifest. A directory that already holds a recording is refused, unless `resume`
    (a resumed run adds its steps to it; the identity must match)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        identity: dict[str, Any],
        config_sha256: str,
        steps: Iterable[int] = (),
        every: int = 1,
        resume: bool = False,
    ) -> None:
        from offbeat.core import __version__

        self.dir = Path(directory)
        self.steps = frozenset(steps)
        self.every = every
        if (self.dir / MANIFEST).exists():
            if not resume:
                raise RecordingError(
                    f"rollout.record.dir={str(self.dir)!r} already holds a recording: choose "
                    f"a new directory or delete it (trainer.resume=true adds to it)"
                )
            self.manifest = read_manifest(self.dir)
            if bad := identity_mismatches(self.manifest["identity"], identity):
                raise RecordingMismatch(
                    f"rollout.record.dir={str(self.dir)!r} holds a recording of another run: "
                    + "; ".join(bad)
                )
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "offbeat_version": __version__,
                "created_unix": time.time(),
                "identity": dict(identity),
                "config_sha256": config_sha256,
                "steps": [],
            }
            self._write_manifest()
        self.queued = 0  # steps handed to the writer thread by this run
        self.written: list[int] = []  # steps written by this run, in order
        self.error: BaseException | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout-record")
        self._pending: list[asyncio.Future] = []

    def wants(self, step: int) -> bool:
        return step in self.steps if self.steps else step % self.every == 0

    # ---- the trainer step hook ---------------------------------------------------------------
    def after_step(
        self, step: int, groups: list[Any], batch: TrajectoryBatch, metrics: dict[str, float]
    ) -> None:
        """Queue the write of this step's batch (the trainer does not use it afterwards)."""
        self._raise_failed()
        if self.wants(step):
            sources = [data_source_of(g.prompt) for g in groups for _ in g.trajectories]
            version = int(metrics.get("weight_version", 0))
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(self._executor, self._write, step, batch, sources, version)
            fut.add_done_callback(self._done)
            self._pending = [f for f in self._pending if not f.done()] + [fut]
            self.queued += 1
        metrics["record/steps"] = float(self.queued)

    async def close(self) -> None:
        """Wait for the queued writes; raise `RecordingError` if one failed."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
            self._pending = []
        self._executor.shutdown(wait=False)
        self._raise_failed()

    # ---- the writer thread -------------------------------------------------------------------
    def _write(self, step: int, batch: TrajectoryBatch, sources: list[str], version: int) -> None:
        data = encode_step(step, batch, sources, version)
        name = step_file(step)
        write_atomic(self.dir / name, data)
        entry = {
            "step": step,
            "file": name,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "rows": len(batch),
            "groups": len(group_runs(batch.group_uids)),
            "weight_version": version,
        }
        steps = [e for e in self.manifest["steps"] if e["step"] != step] + [entry]
        self.manifest["steps"] = sorted(steps, key=lambda e: e["step"])
        self._write_manifest()  # only now is the step part of the recording
        self.written.append(step)

    def _write_manifest(self) -> None:
        write_atomic(self.dir / MANIFEST, (json.dumps(self.manifest, indent=1) + "\n").encode())

    def _done(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is None:
            return
        if self.error is None:
            self.error = fut.exception()
        logger.error("recording a step to %s failed: %s", self.dir, fut.exception())

    def _raise_failed(self) -> None:
        if self.error is not None:
            raise RecordingError(
                f"writing the rollout recording to {str(self.dir)!r} failed: "
                f"{type(self.error).__name__}: {self.error}"
            ) from self.error

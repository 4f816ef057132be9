"""Replay a rollout recording (`rollout.replay`): train on recorded batches instead of
generating them.

Three small wrappers, wired in by `attach` (the job calls it once):
- `ReplayLoader` wraps the dataloader. While the recording lasts it hands out marker rows
  (`{"data_source", "replay": {"pos", "step", "group"}}`) in recorded order instead of
  prompts. `cache` goes through the recording once, skipping as many dataset rows (so
  the live steps that follow see the prompts a live run would), then hands out dataset
  rows; `repeat` cycles through the recording for the whole run.
- `ReplayAgent` wraps the agent loop. A marker's group is its recorded trajectories, read
  off the event loop and re-tagged with the group's new uid (its new prompt id) and the
  weight version the replicas hold now, so spans, staleness and evictions treat it like
  a group generated now. Replayed groups finish in recorded order, so with the recorded
  `data.train_batch_size` each step trains exactly the groups of one recorded step.
  Other rows go to the wrapped agent loop (live generation).
- `ReplayMetrics`, a trainer step hook: `replay/<mode>_frac` (the share of the step's
  groups that came from the recording), `replay/groups_total`; it takes replayed tokens
  out of `perf/tokens_per_s`.

Markers travel through the replay buffer like prompts, so admission, staleness and
accounting are those of live groups, and the weight sync still happens every step (the
replicas stay current for the live steps and validation). Knows nothing about engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offbeat.core.data import Trajectory
from offbeat.core.rollout.recording import (
    REPLAY_MODES,
    CorruptRecording,
    RecordingError,
    RecordingMismatch,
    config_digest,
    decode_step,
    group_runs,
    identity_mismatches,
    read_manifest,
    read_step_metadata,
    run_identity,
    verify_files,
)

if TYPE_CHECKING:
    from offbeat.core.config.run import RunConfig

__all__ = [
    "MARKER",
    "REPLAY_MODES",
    "RecordReplay",
    "Recording",
    "ReplayAgent",
    "ReplayLoader",
    "ReplayMetrics",
    "attach",
    "is_replayed",
]

logger = logging.getLogger(__name__)

MARKER = "replay"  # the key of a marker row
_CACHED_STEPS = 3  # decoded recorded steps kept in memory by a ReplayAgent


def is_replayed(row: Any) -> bool:
    return isinstance(row, Mapping) and isinstance(row.get(MARKER), Mapping)


class Recording:
    """A verified recording: every listed file read and checked against its sha256, and
    the index of its groups in recorded order, (step, group in step, data_source)."""

    def __init__(self, directory: Path, manifest: dict[str, Any], index: list[tuple]) -> None:
        self.dir = directory
        self.manifest = manifest
        self.index = index
        self.entries = {e["step"]: e for e in manifest["steps"]}
        self.n = int(manifest["identity"]["n"])

    @classmethod
    def open(cls, directory: str | Path, identity: dict[str, Any]) -> Recording:
        """Read and check the recording in `directory` against this run's `identity`;
        raises `RecordingError` (`RecordingMismatch`, `CorruptRecording`) saying why it
        cannot be replayed. Blocking: reads every file."""
        d = Path(directory)
        where = f"rollout.replay.dir={str(d)!r}"
        try:
            manifest = read_manifest(d)
        except RecordingError as e:
            raise type(e)(f"{where}: {e}") from e
        if not manifest["steps"]:
            raise RecordingError(f"{where}: the recording holds no step (its run recorded none)")
        if bad := identity_mismatches(manifest["identity"], identity):
            raise RecordingMismatch(
                f"{where} was recorded by another setup: {'; '.join(bad)}. Replay it with "
                f"the model, tokenizer and rollout.n it was recorded with, or record again"
            )
        try:
            verify_files(d, manifest, hashes=True)
            index = []
            for entry in manifest["steps"]:
                meta = read_step_metadata(d / entry["file"])
                uids, sources = json.loads(meta["group_uids"]), json.loads(meta["data_sources"])
                runs = group_runs(uids)
                if len(runs) != entry["groups"] or len(uids) != entry["rows"]:
                    raise CorruptRecording(f"{d / entry['file']}: rows disagree with the manifest")
                index += [(entry["step"], j, sources[a]) for j, (a, _) in enumerate(runs)]
        except CorruptRecording as e:
            raise CorruptRecording(f"{where}: {e}; record it again") from e
        except (KeyError, ValueError) as e:
            raise CorruptRecording(f"{where}: malformed step header ({e}); record again") from e
        return cls(d, manifest, index)

    def load_groups(self, step: int) -> list[list[Trajectory]]:
        """The trajectories of recorded `step`, group by group (blocking: a file read)."""
        entry = self.entries[step]
        path = self.dir / entry["file"]
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CorruptRecording(f"{path}: changed since the replay began (sha256 differs)")
        batch, meta = decode_step(data, str(path))
        rows = batch.unpad()
        groups = [rows[a:b] for a, b in group_runs(meta["group_uids"])]
        if any(len(g) != self.n for g in groups):
            raise CorruptRecording(f"{path}: a group without rollout.n={self.n} trajectories")
        return groups


class ReplayLoader:
    """The dataloader, with the recording's groups first (`cache`) or only (`repeat`)."""

    def __init__(self, loader: Any, recording: Recording, mode: str) -> None:
        self.loader = loader
        self.recording = recording
        self.mode = mode
        self.position = 0  # markers handed out so far (over every cycle)

    @property
    def live(self) -> bool:
        """Whether the recording is used up and rows come from the dataset."""
        return self.mode == "cache" and self.position >= len(self.recording.index)

    def __len__(self) -> int:
        return len(self.loader)

    def next(self, k: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        total = len(self.recording.index)
        while len(out) < k and not self.live:
            step, group, source = self.recording.index[self.position % total]
            marker = {"pos": self.position, "step": step, "group": group}
            out.append({"data_source": source, MARKER: marker})
            self.position += 1
        if self.mode == "cache" and out:
            self.loader.next(len(out))  # the prompts these groups stand for are used
        if len(out) < k:
            out += self.loader.next(k - len(out))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict(), "replay_position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "replay_position" not in state:  # a checkpoint of a run without replay
            self.loader.load_state_dict(state)
            return
        self.loader.load_state_dict(state["loader"])
        self.position = int(state["replay_position"])


class ReplayAgent:
    """The agent loop, answering marker rows from the recording (see the module doc).
    `version()`: the weight version the replicas hold now."""

    def __init__(self, agent: Any, recording: Recording, version: Callable[[], int]) -> None:
        self.agent = agent
        self.recording = recording
        self.version = version
        self.replayed_groups = 0
        self.replayed_tokens = 0
        self._steps: dict[int, asyncio.Task] = {}  # recorded step -> its decoded groups
        self._inflight: set[int] = set()  # marker positions being answered
        self._waiters: list[asyncio.Future] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.agent, name)

    async def sample(
        self, uid: str, row: Mapping[str, Any], n: int, sampling: Mapping[str, Any] | None = None
    ) -> list[Trajectory]:
        if not is_replayed(row):
            return await self.agent.sample(uid, row, n, sampling)
        marker = row[MARKER]
        pos = int(marker["pos"])
        self._inflight.add(pos)
        try:
            groups = await self._groups(int(marker["step"]))
            recorded = groups[int(marker["group"])]
            if len(recorded) != n:
                raise RecordingMismatch(
                    f"recorded groups hold {len(recorded)} trajectories, rollout.n={n}"
                )
            # Finish in recorded order: the workers took the markers oldest first, so every
            # earlier one is in `_inflight` until it returns.
            while min(self._inflight) < pos:
                fut = asyncio.get_running_loop().create_future()
                self._waiters.append(fut)
                await fut
            version = int(self.version())
            out = [
                dataclasses.replace(
                    t,
                    prompt_ids=list(t.prompt_ids),
                    response_ids=list(t.response_ids),
                    rollout_log_probs=list(t.rollout_log_probs),
                    group_uid=uid,
                    session_id=uid,
                    min_weight_version=version,
                    max_weight_version=version,
                    extras=dict(t.extras),
                )
                for t in recorded
            ]
            self.replayed_groups += 1
            self.replayed_tokens += sum(len(t.response_ids) for t in out)
            return out
        finally:
            self._inflight.discard(pos)
            waiters, self._waiters = self._waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    async def _groups(self, step: int) -> list[list[Trajectory]]:
        task = self._steps.get(step)
        if task is None:
            task = asyncio.ensure_future(asyncio.to_thread(self.recording.load_groups, step))
            self._steps[step] = task
            while len(self._steps) > _CACHED_STEPS:
                self._steps.pop(next(iter(self._steps)))
        return await asyncio.shield(task)


class ReplayMetrics:
    """Trainer step hook: how much of each step was replayed, in which mode."""

    def __init__(self, mode: str, agent: ReplayAgent) -> None:
        self.mode = mode
        self.agent = agent
        self._tokens = 0

    def after_step(self, step: int, groups: list[Any], batch: Any, metrics: dict) -> None:
        replayed = sum(1 for g in groups if is_replayed(g.prompt))
        metrics[f"replay/{self.mode}_frac"] = replayed / len(groups) if groups else 0.0
        metrics["replay/groups_total"] = float(self.agent.replayed_groups)
        tokens, self._tokens = self.agent.replayed_tokens - self._tokens, self.agent.replayed_tokens
        step_s = metrics.get("timing/step_s", 0.0)
        if "perf/tokens_per_s" in metrics and step_s > 0:
            live = metrics["perf/tokens_per_s"] - tokens / step_s
            metrics["perf/tokens_per_s"] = max(0.0, live)

    async def close(self) -> None:
        return None


@dataclasses.dataclass
class RecordReplay:
    """What `attach` hands back to the job: the loader and agent for the rollout driver
    (wrapped when replaying), the trainer step hooks, and lines for the run header."""

    loader: Any
    agent: Any
    hooks: list[Any] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def attach(
    cfg: RunConfig,
    *,
    model: str,
    model_dir: str | Path,
    tokenizer: Any,
    loader: Any,
    agent: Any,
    version: Callable[[], int],
) -> RecordReplay:
    """Wire `cfg.rollout.replay` and `cfg.rollout.record` around the job's `loader` and
    `agent`. `model`: model.path as configured. Blocking (hashes the vocabulary, reads the
    recording): call it in a thread. Raises `RecordingError` when the recording to replay
    does not fit this run, or the directory to record into holds another run's."""
    from offbeat.core.rollout.record import Recorder

    ro = cfg.rollout
    out = RecordReplay(loader, agent)
    if not ro.record.dir and not ro.replay.dir:
        return out
    identity = run_identity(model, model_dir, tokenizer, ro.n)
    if ro.replay.dir:
        recording = Recording.open(ro.replay.dir, identity)
        out.loader = ReplayLoader(loader, recording, ro.replay.mode)
        out.agent = ReplayAgent(agent, recording, version)
        out.hooks.append(ReplayMetrics(ro.replay.mode, out.agent))
        out.notes.append(
            f"replay ({ro.replay.mode}) of {ro.replay.dir}: {len(recording.entries)} recorded "
            f"steps, {len(recording.index)} groups"
        )
    if ro.record.dir:
        rec = ro.record
        out.hooks.append(
            Recorder(
                rec.dir,
                identity=identity,
                config_sha256=config_digest(cfg),
                steps=rec.steps,
                every=rec.every,
                resume=cfg.trainer.resume,
            )
        )
        which = f"steps {list(rec.steps)}" if rec.steps else f"every {rec.every} step(s)"
        out.notes.append(f"recording {which} to {rec.dir}")
    return out

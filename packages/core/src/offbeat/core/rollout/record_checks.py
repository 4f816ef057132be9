"""Config rules for `rollout.record` and `rollout.replay`, run by
`offbeat.core.config.validate` before anything starts (`offbeat check` included).

Registered with `@check` on import (`offbeat.core.trainer.job` imports this module).
Statically it rejects: a bad replay mode (whether or not replay is on), settings of a
record/replay that is off, record steps that are not steps of the run, `steps` together
with `every`, recording into a file, into a directory that already holds a recording
(unless `trainer.resume`) or into the recording being replayed; a replay directory that
is missing or holds no readable recording, whose listed step files are missing or of
another size, or that was recorded with another `model.path`, `rollout.n` or (when the
tokenizer loads offline) vocabulary. What it cannot see (a file altered in place, the
model's config) the run refuses when it opens the recording, before the first step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offbeat.core.config.validation import Problems, check
from offbeat.core.rollout.recording import (
    MANIFEST,
    REPLAY_MODES,
    RecordingError,
    read_manifest,
    tokenizer_digest,
    verify_files,
)

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

__all__: list[str] = []

log = logging.getLogger(__name__)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _same_dir(a: str, b: str) -> bool:
    return bool(a) and bool(b) and Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


@check
def _record(cfg: JobConfig, p: Problems) -> None:
    rec = getattr(cfg.rollout, "record", None)
    if rec is None:
        return
    if not isinstance(rec.dir, str) or not rec.dir.strip():
        for key, value, default in (("steps", list(rec.steps), []), ("every", rec.every, 1)):
            if value != default:
                p.add(
                    f"rollout.record.{key}",
                    value,
                    f"only read when rollout.record.dir is set: set the directory to record "
                    f"into, or leave {key} at {default}",
                )
        return
    steps = list(rec.steps)
    total = cfg.trainer.total_training_steps
    if p.require_int("rollout.record.every", rec.every) and steps and rec.every != 1:
        p.add(
            "rollout.record.every",
            rec.every,
            f"rollout.record.steps={steps} already names the steps: set one of the two "
            f"(leave every at 1 with steps)",
        )
    bad = [s for s in steps if not _is_int(s) or s < 1 or (_is_int(total) and s > total)]
    if bad or len(set(steps)) != len(steps):
        p.add(
            "rollout.record.steps",
            steps,
            f"distinct global steps in 1..trainer.total_training_steps={total}"
            + (f" ({bad} are not)" if bad else " (some repeat)"),
        )
    d = Path(rec.dir).expanduser()
    if d.exists() and not d.is_dir():
        p.add("rollout.record.dir", rec.dir, "a directory to record into (this is a file)")
    elif (d / MANIFEST).exists() and cfg.trainer.resume is not True:
        p.add(
            "rollout.record.dir",
            rec.dir,
            "a new directory: this one already holds a recording (delete it, or set "
            "trainer.resume=true to add the resumed steps to it)",
        )
    replay = getattr(cfg.rollout, "replay", None)
    if replay is not None and isinstance(replay.dir, str) and _same_dir(rec.dir, replay.dir):
        p.add(
            "rollout.record.dir",
            rec.dir,
            "a directory other than rollout.replay.dir (the recording being replayed)",
        )


@check
def _replay(cfg: JobConfig, p: Problems) -> None:
    rp = getattr(cfg.rollout, "replay", None)
    if rp is None:
        return
    mode_ok = p.require_choice("rollout.replay.mode", rp.mode, REPLAY_MODES)
    if not isinstance(rp.dir, str) or not rp.dir.strip():
        if mode_ok and rp.mode != "cache":
            p.add(
                "rollout.replay.mode",
                rp.mode,
                "only read when rollout.replay.dir is set: set the recording to replay, or "
                "leave mode at cache",
            )
        return
    key = "rollout.replay.dir"
    d = Path(rp.dir).expanduser()
    if not d.is_dir():
        p.add(key, rp.dir, "an existing directory holding a rollout recording (none here)")
        return
    try:
        manifest = read_manifest(d)
        verify_files(d, manifest, hashes=False)  # sizes only; the run checks every sha256
    except RecordingError as e:
        p.add(key, rp.dir, f"a readable rollout recording: {e}")
        return
    if not manifest["steps"]:
        p.add(key, rp.dir, "a recording with at least one step (this one holds none)")
    ident = manifest["identity"]
    if ident.get("model") != cfg.model.path:
        p.add(
            "model.path",
            cfg.model.path,
            f"the model {key}={rp.dir!r} was recorded with: {ident.get('model')!r}",
        )
    if _is_int(cfg.rollout.n) and ident.get("n") != cfg.rollout.n:
        p.add(
            "rollout.n",
            cfg.rollout.n,
            f"{ident.get('n')}, the group size {key}={rp.dir!r} was recorded with",
        )
    _same_vocabulary(cfg, ident, p)


def _same_vocabulary(cfg: JobConfig, ident: dict[str, Any], p: Problems) -> None:
    """Compare the tokenizer when it loads offline (see offbeat.core.tasks.checks)."""
    from offbeat.core.tasks.checks import _load_tokenizer

    try:
        tokenizer = _load_tokenizer(cfg)
    except Exception as e:  # an unloadable tokenizer is the run's to report
        log.debug("replay vocabulary rule skipped: tokenizer did not load (%s)", e)
        return
    if tokenizer is None:
        return
    digest, size = tokenizer_digest(tokenizer)
    if (digest, size) != (ident.get("tokenizer_sha256"), ident.get("vocab_size")):
        p.add(
            "rollout.replay.dir",
            cfg.rollout.replay.dir,
            f"a recording made with this run's tokenizer: it was recorded with another "
            f"vocabulary ({ident.get('vocab_size')} tokens, sha256 "
            f"{str(ident.get('tokenizer_sha256'))[:12]}...; this run: {size} tokens, "
            f"sha256 {digest[:12]}...)",
        )

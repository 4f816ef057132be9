"""Automatic restarts: a run that a dead trainer rank stopped resumes from its newest
checkpoint, in the same process, up to `trainer.max_restarts` times.

`run_with_restarts(run, cfg)` wraps a job function (`run_job`, `run_opd`, `run_genrm`:
anything that takes the config and returns the run's summary). A failure restarts only
when a restart can cure it: a `TrainerRankFailed` whose rank's process is gone (killed,
OOM-killed, crashed), anywhere in the error's cause chain. A rank's own exception, a call
past its timeout, a stall, a config or reward error, Ctrl-C: raised as they are. The
restarted run is the same config with `trainer.resume=true`; the job function builds
everything afresh (pools, replicas, the trainer group) and the trainer resumes from the
newest complete checkpoint, prompt ledger included, so the data order goes on exactly.

Knows nothing of what the job function builds, nor of Ray: the rank failure says itself
whether the rank died (`TrainerRankFailed.died`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from offbeat.core.runtime.group import TrainerRankFailed

if TYPE_CHECKING:
    from offbeat.core.config.schema import TrainerConfig

__all__ = ["AUTO_RESTARTS", "max_restarts", "restart_cause", "run_with_restarts"]

logger = logging.getLogger(__name__)

AUTO_RESTARTS = 2  # trainer.max_restarts=null with checkpoints mid-run (see the schema)

C = TypeVar("C")


def max_restarts(t: TrainerConfig) -> int:
    """`trainer.max_restarts`, or when null: `AUTO_RESTARTS` with checkpoints mid-run
    (`trainer.save_freq > 0`), else 0."""
    n = getattr(t, "max_restarts", None)
    if n is None:
        return AUTO_RESTARTS if t.save_freq > 0 else 0
    return int(n)


def restart_cause(error: BaseException) -> TrainerRankFailed | None:
    """The dead rank's failure that `error` comes from (itself, a cause or context of it,
    or one of an exception group's), or None when a restart cannot cure `error`."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, TrainerRankFailed):
            if e.died:
                return e
            continue  # the rank raised, or timed out: a restart would meet it again
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: the user's stop
            return None
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend([e.__cause__, e.__context__])
    return None


def _resumed(cfg: C) -> C:
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume=True))


async def run_with_restarts(run: Callable[[C], Awaitable[dict[str, Any]]], cfg: C) -> dict:
    """`await run(cfg)`; when it fails because a trainer rank died, `await run(cfg with
    trainer.resume=true)` again, up to `max_restarts(cfg.trainer)` times. Each restart is logged
    (a warning) with its cause; the summary gets `restarts` (how many) and
    `restart_causes` (each failure's message). The failure past the limit is raised."""
    limit = max_restarts(cfg.trainer)
    causes: list[str] = []
    attempt = cfg
    while True:
        try:
            summary = await run(attempt)
        except Exception as e:
            failed = restart_cause(e)
            if failed is None or len(causes) >= limit:
                if failed is not None and limit:
                    logger.error("no restart left (trainer.max_restarts=%d): %s", limit, failed)
                raise
            causes.append(str(failed))
            msg = (
                f"restart {len(causes)}/{limit} from the last checkpoint "
                f"(trainer.max_restarts): {failed}"
            )
            logger.warning(msg)
            attempt = _resumed(cfg)
            continue
        summary["restarts"] = len(causes)
        summary["restart_causes"] = causes
        return summary

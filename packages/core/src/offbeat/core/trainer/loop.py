"""The training loop of a job, built from its two sides: the `Trainer` over the trainer
side's engine (and critic and reference engines) and the rollout side's buffer, driver
and pool, with the run's validator, checkpoints, metrics tracker and step timeline, and
the extensions' hooks. `TrainingLoop.run` trains to the end and writes the plot.

Knows the job config and the extensions' seams; not how either side was started
(`offbeat.core.runtime.launch`, `offbeat.core.trainer.rollout_side`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offbeat.core.trace import Tracer
    from offbeat.core.trainer.prepare import Prepared
    from offbeat.core.trainer.rollout_side import RolloutSide
    from offbeat.core.trainer.tracking import MetricsTracker
    from offbeat.core.trainer.trainer import Trainer

__all__ = ["TrainingLoop", "build_loop"]


@dataclass
class TrainingLoop:
    """The trainer and what records its run; `close` ends a run that failed (after
    `run` it does nothing)."""

    trainer: Trainer
    tracker: MetricsTracker
    tracer: Tracer | None
    run_dir: Path
    plot: Path | None = None

    async def run(self, header: str) -> dict[str, Any]:
        """Log `header`, train to the end, then the plot (`self.plot`); the trainer's
        summary."""
        self.tracker.event(header)
        summary = await self.trainer.run()
        self.plot = self.tracker.finish(self.trace_path)
        return summary

    @property
    def trace_path(self) -> Path | None:
        return self.tracer.path if self.tracer is not None else None

    async def close(self) -> None:
        self.tracker.close(artifacts=[self.trace_path], failed=True)


def build_loop(
    p: Prepared,
    side: Any,
    rollout: RolloutSide,
    extensions: Sequence[Any],
    *,
    pad_token_id: int,
    version_offset: int,
) -> TrainingLoop:
    """The training loop of `p` over the trainer `side` and the `rollout` side. The
    critic and the reference model, when the algorithm needs them, run on the trainer
    group's ranks (critic.placement=actor, ref.placement=actor; the one local rank with
    the trainer in the driver) or on groups of their own; the side carries their
    engines."""
    from offbeat.core.tasks import read_parquet
    from offbeat.core.trainer import extension as ext
    from offbeat.core.trainer.checkpoint import make_checkpoints
    from offbeat.core.trainer.ppo import CriticAndReference
    from offbeat.core.trainer.tracking import make_tracer, make_tracker
    from offbeat.core.trainer.trainer import Trainer

    cfg = p.cfg
    run_dir = Path(cfg.trainer.log_dir) / cfg.trainer.experiment_name
    run_dir.mkdir(parents=True, exist_ok=True)
    val_rows = [r for f in p.val_files for r in read_parquet(f)]
    validator = ext.job_validator(cfg, rollout.agent, val_rows, extensions)
    critic_ref = CriticAndReference.build(
        cfg.algorithm, cfg.critic, cfg.rollout,
        critic_engine=side.critic_engine, reference_engine=side.reference_engine,
    )  # fmt: skip
    tracer = make_tracer(cfg.trainer, run_dir)
    checkpoints = make_checkpoints(cfg.trainer, cfg.runtime.checkpoint_keep_last)
    tracker = make_tracker(cfg, run_dir, checkpoints)
    loop = None
    try:
        trainer = Trainer(
            cfg, pad_token_id=pad_token_id, engine=side.engine, buffer=rollout.buffer,
            driver=rollout.driver, pool=rollout.pool, tracker=tracker, checkpoints=checkpoints,
            validator=validator, rollout_memory=rollout.memory, version_offset=version_offset,
            tracer=tracer, hybrid=rollout.hybrid, critic_ref=critic_ref,
            step_hooks=[*rollout.hooks, *(h for e in extensions for h in e.step_hooks())],
            batch_hook=ext.batch_hook(extensions),
        )  # fmt: skip
        loop = TrainingLoop(trainer, tracker, tracer, run_dir)
    finally:
        if loop is None:
            tracker.close(artifacts=[tracer.path if tracer is not None else None], failed=True)
    return loop

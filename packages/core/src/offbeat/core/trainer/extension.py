"""The one seam a recipe (or a reward) extends the separate_async job through.

A `JobExtension` is a plain class whose every method is optional: the default does
nothing, so an extension overrides only the points it needs. `run_job(cfg,
extensions=[...])` calls them in this order, each extension in list order:

    configure(cfg) -> cfg          blocking, in a worker thread, before Ray starts
    pools(cfg) -> [PoolSpec]       named resource pools reserved beside the job's
    start_replicas(cfg, pools)     replicas it starts (not awaited); the job shuts them down
    await setup(prepared, pools)   on the event loop, once the replicas are up
    wrap_agent(agent)              the loop training groups are sampled with
    validation_agent(agent)        the loop validation samples with
    make_validator(cfg, agent, rows)   a validator in place of the job's (None: no say)
    batch_hook(batch, data)        each train batch, in a worker thread (`Trainer.batch_hook`)
    step_hooks()                   trainer step hooks (`after_step`, `close`)
    await report(summary)          adds to the run's summary, after the last step
    await close()                  always, at the end; then `replacements()` are shut down

A reward may declare the extension it needs: `REWARD_EXTENSIONS` (offbeat.core.registry)
maps a `reward.name` to a zero-argument factory, and `run_job` adds it after the
caller's. Knows no recipe, no reward and no engine: only the order of the calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from offbeat.core.config import JobConfig

if TYPE_CHECKING:
    from offbeat.core.config.run import RunConfig

__all__ = [
    "JobExtension",
    "batch_hook",
    "close_extensions",
    "configure",
    "extra_pools",
    "job_validator",
    "make_validator",
    "overrides",
    "reward_extensions",
]


class JobExtension:
    """A recipe's part of the job; see the module docstring for when each method runs."""

    def configure(self, cfg: JobConfig) -> JobConfig:
        """The config with what this extension builds filled in (task files, models).
        Blocking: runs in a worker thread before Ray starts and before anything is
        pinned, so a build may use every core."""
        return cfg

    def pools(self, cfg: JobConfig) -> list[Any]:
        """Extra named resource pools (`PoolSpec`s) reserved with the job's."""
        return []

    def start_replicas(self, cfg: JobConfig, pools: Any) -> dict[str, Any]:
        """{server_id: replica} it starts (not awaited), in its bundles of `pools`; the job
        shuts them down at the end. They never join the weight sync."""
        return {}

    async def setup(self, prepared: Any, pools: Any) -> None:
        """Once the rollout replicas answer, before the agent is built (on the event loop)."""

    def wrap_agent(self, agent: Any) -> Any:
        """The agent loop training groups are sampled with (validation keeps its own)."""
        return agent

    def validation_agent(self, agent: Any) -> Any:
        """The agent loop validation samples with."""
        return agent

    def make_validator(self, cfg: JobConfig, agent: Any, rows: list) -> Any:
        """A validator in place of the job's (`Validator.build`; None: no say)."""
        return None

    def batch_hook(self, batch: Any, data: dict[str, Any]) -> dict[str, float]:
        """Each train batch, in a worker thread: may replace `data["advantages"]`; returns
        metrics. Called only when a subclass overrides it."""
        return {}

    def step_hooks(self) -> list[Any]:
        """Trainer step hooks: `after_step(step, groups, batch, metrics)`, `await close()`."""
        return []

    async def report(self, summary: dict[str, Any]) -> None:
        """Add to the run's summary after the last step (its replicas still up)."""

    async def close(self) -> None:
        """Always, at the end of the run, after `report` (also when the run failed)."""

    def replacements(self) -> dict[str, Any]:
        """{server_id: replica} it started in place of dead ones; shut down after `close`."""
        return {}


def overrides(ext: JobExtension, name: str) -> bool:
    """Whether `ext`'s class overrides `JobExtension.<name>` (Lightning's `is_overridden`)."""
    return getattr(type(ext), name, None) is not getattr(JobExtension, name)


def reward_extensions(cfg: JobConfig) -> list[JobExtension]:
    """The extension `reward.name` declares in `REWARD_EXTENSIONS`, or none."""
    from offbeat.core.registry import REWARD_EXTENSIONS

    name = cfg.reward.name
    return [REWARD_EXTENSIONS.get(name)()] if name in REWARD_EXTENSIONS else []


def configure(cfg: JobConfig, extensions: Sequence[JobExtension]) -> JobConfig:
    """`cfg` through every extension's `configure`, in order (blocking)."""
    for ext in extensions:
        cfg = ext.configure(cfg)
    return cfg


def extra_pools(cfg: JobConfig, extensions: Sequence[JobExtension]) -> list[Any]:
    return [spec for ext in extensions for spec in ext.pools(cfg)]


def job_validator(
    cfg: RunConfig, agent: Any, rows: list, extensions: Sequence[JobExtension]
) -> Any:
    """The run's validator over `rows`: on the agent the extensions' `validation_agent`
    make of `agent`, the first validator an extension makes, else the job's
    (`Validator.build`); with `agent.val_without_tools` the policy without its tools is
    scored beside it (`val/reward_no_tools`)."""
    from offbeat.core.trainer.validation import Validator

    for ext in extensions:
        agent = ext.validation_agent(agent)
    validator = make_validator(
        cfg, agent, rows, extensions, lambda c, a, r: Validator.build(c.trainer, c.data, a, r)
    )
    if validator is not None and cfg.agent.val_without_tools:
        validator.baselines["no_tools"] = agent.loop("single_turn")
    return validator


def make_validator(
    cfg: JobConfig, agent: Any, rows: list, extensions: Sequence[JobExtension], default: Callable
) -> Any:
    """The first validator an extension makes, else `default(cfg, agent, rows)`."""
    for ext in extensions:
        v = ext.make_validator(cfg, agent, rows)
        if v is not None:
            return v
    return default(cfg, agent, rows)


def batch_hook(extensions: Sequence[JobExtension]) -> Callable | None:
    """One `Trainer.batch_hook` running every overriding extension's in order (their
    metrics merged); None when none overrides it."""
    hooks = [ext.batch_hook for ext in extensions if overrides(ext, "batch_hook")]
    if len(hooks) <= 1:
        return hooks[0] if hooks else None

    def run_all(batch: Any, data: dict[str, Any]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for hook in hooks:
            metrics.update(hook(batch, data) or {})
        return metrics

    return run_all


async def close_extensions(extensions: Sequence[JobExtension]) -> None:
    """Close every extension (the last first), each even when one before failed, and shut
    down the replacements it started."""
    from offbeat.core.trainer.elastic import shutdown_replicas

    errors: list[BaseException] = []
    for ext in reversed(extensions):
        try:
            await ext.close()
        except Exception as e:  # the others still close; the first error is raised
            errors.append(e)
        if started := ext.replacements():
            await shutdown_replicas(started)
    if errors:
        raise errors[0]

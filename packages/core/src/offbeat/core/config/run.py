"""`RunConfig`: the job config a recipe runs, `JobConfig` plus the sections of the
components the job assembly adds (a synthetic task when no dataset is given, the agent
loop, a brief warm start, the runtime's knobs).

Each section is owned by its component (`offbeat.core.tasks.synthetic`,
`offbeat.core.agent.loops`, `offbeat.core.trainer.warm_start`, `offbeat.core.runtime.config`);
this module only composes them. Not imported by `offbeat.core.config` itself: a bare
`JobConfig` needs none of these components.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from offbeat.core.agent.loops import AgentConfig
from offbeat.core.config.schema import JobConfig
from offbeat.core.runtime.config import RuntimeConfig
from offbeat.core.tasks.synthetic import SyntheticTaskConfig
from offbeat.core.trainer.warm_start import WarmStartConfig

__all__ = ["RunConfig"]


@dataclass
class RunConfig(JobConfig):
    """A job config plus what the embedded default needs: a synthetic task when no
    dataset is given, a brief warm start, and runtime knobs."""

    task: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

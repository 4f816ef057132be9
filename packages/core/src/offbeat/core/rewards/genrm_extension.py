"""GenRM's part of the job: what `reward.name=genrm` needs beyond a scorer, as the
`JobExtension` that reward declares (`REWARD_EXTENSIONS["genrm"]`, added by `run_job`).

Before Ray: an `offbeat-tiny:<size>` judge model is built (untrained) into the cache. Then
the "judge" resource pool, the judge replicas in it (`reward.genrm.replicas`), and once
they answer, the judge installed for the `genrm` scorer behind a balancer of its own (or
`reward.genrm.url`) with its step hook; validation by the rule with
`reward.genrm.val_reward=task`; the judge's totals as the summary's "genrm". The pieces
are `genrm_replicas`'; this module only says when each runs. Knows nothing of the trainer.
"""

from __future__ import annotations

from typing import Any

from offbeat.core.config import JobConfig
from offbeat.core.registry import REWARD_EXTENSIONS
from offbeat.core.rewards import genrm_replicas
from offbeat.core.trainer.extension import JobExtension

__all__ = ["GenRMExtension"]


class GenRMExtension(JobExtension):
    """The judge of `reward.genrm`: its replicas, its transport and its step hook."""

    def __init__(self) -> None:
        self.cfg: JobConfig | None = None
        self.judges: dict[str, Any] = {}
        self.hook: Any = None  # genrm_replicas.GenRMStepHook, once set up

    def configure(self, cfg: JobConfig) -> JobConfig:
        from offbeat.core.models import cache_root

        return genrm_replicas.resolve_judge_model(cfg, cache_root())

    def pools(self, cfg: JobConfig) -> list[Any]:
        return genrm_replicas.judge_pools(cfg)

    def start_replicas(self, cfg: JobConfig, pools: Any) -> dict[str, Any]:
        self.judges = genrm_replicas.start_judges(cfg, pools)
        return self.judges

    async def setup(self, prepared: Any, pools: Any) -> None:
        self.cfg = prepared.cfg
        self.hook = await genrm_replicas.start_judge(self.cfg, self.judges, pools)

    def validation_agent(self, agent: Any) -> Any:
        return genrm_replicas.validation_agent(self.cfg, agent)

    def step_hooks(self) -> list[Any]:
        return [self.hook] if self.hook is not None else []

    async def report(self, summary: dict[str, Any]) -> None:
        summary["genrm"] = self.hook.summary() if self.hook is not None else None

    async def close(self) -> None:
        # Uninstalls the judge and stops its replacements being started (idempotent: the
        # trainer closes its step hooks too); the job then shuts down `replacements()`.
        if self.hook is not None:
            await self.hook.close()

    def replacements(self) -> dict[str, Any]:
        return self.hook.replacements() if self.hook is not None else {}


REWARD_EXTENSIONS.register("genrm", GenRMExtension)

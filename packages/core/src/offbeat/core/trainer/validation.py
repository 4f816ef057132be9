"""Validation on the rollout replicas: greedy answers to a fixed prompt set, scored.

Knows nothing about training: it runs the agent loop (one sample per prompt, greedy by
default) through the same client and balancer the training rollout uses, so validation
requests interleave with training generation on the same replicas. `baselines` are
other agents scored on the same rows in the same run (e.g. the policy without its tools:
`val/reward_no_tools`). Each prompt scored (or failed) is reported to the run's progress
registry (stage "validation").
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from offbeat.core import progress
from offbeat.core.trainer.agent_loop import GroupFailed, SingleTurnAgentLoop

if TYPE_CHECKING:
    from offbeat.core.config.schema import DataConfig, TrainerConfig


class Validator:
    """Mean reward of `agent` over `rows` (failed rows score 0 and are counted)."""

    def __init__(
        self,
        agent: SingleTurnAgentLoop,
        rows: Sequence[Mapping[str, Any]],
        *,
        sampling: Mapping[str, Any] | None = None,
        max_concurrency: int = 64,
        baselines: Mapping[str, Any] | None = None,
    ) -> None:
        if not rows:
            raise ValueError("Validator: no validation rows")
        self.agent = agent
        self.rows = list(rows)
        self.sampling = dict(sampling if sampling is not None else {"temperature": 0.0})
        self.max_concurrency = max_concurrency
        self.baselines = dict(baselines or {})

    @classmethod
    def build(
        cls,
        trainer: TrainerConfig,
        data: DataConfig,
        agent: SingleTurnAgentLoop,
        rows: Sequence[Mapping[str, Any]],
    ) -> Validator | None:
        """The job's validator (`data.val_batch_size` prompts in flight at once), or None
        when there are no rows or the job never validates (`trainer.test_freq`,
        `trainer.val_before_train`)."""
        if not rows or not (trainer.test_freq > 0 or trainer.val_before_train):
            return None
        return cls(agent, rows, max_concurrency=data.val_batch_size)

    async def run(self, tag: str = "val") -> dict[str, float]:
        sem = asyncio.Semaphore(self.max_concurrency)

        async def one(agent: Any, i: int, row: Mapping[str, Any]) -> tuple[float, float, bool]:
            async with sem:
                try:
                    (t,) = await agent.sample(f"{tag}-{i}", row, 1, self.sampling)
                except GroupFailed as e:
                    progress.fail("validation", error=f"{tag}-{i} ({e.reason}): {e}")
                    return 0.0, 0.0, False
                progress.advance("validation")
                return t.reward, float(len(t.response_ids)), True

        runs = [
            asyncio.gather(*(one(agent, i, r) for i, r in enumerate(self.rows)))
            for agent in (self.agent, *self.baselines.values())
        ]
        results, *others = await asyncio.gather(*runs)
        rewards = [r for r, _, _ in results]
        lengths = [n for _, n, ok in results if ok]
        extra = {
            f"val/reward_{name}": sum(r for r, _, _ in res) / len(res)
            for name, res in zip(self.baselines, others, strict=True)
        }
        return {
            **extra,
            "val/reward": sum(rewards) / len(rewards),
            "val/exact": sum(r >= 1.0 for r in rewards) / len(rewards),
            "val/response_length": sum(lengths) / len(lengths) if lengths else 0.0,
            "val/failed": float(sum(not ok for _, _, ok in results)),
        }

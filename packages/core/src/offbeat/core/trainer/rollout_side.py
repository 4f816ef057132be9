"""The rollout side of a job, built around running replicas: the balancer in front of
them, the partial-rollout client, the replica pool that syncs, heals and replaces them,
the agent loop (training's, wrapped by the recipe's extensions and by record/replay;
validation's), the dataloader, the replay buffer and the rollout driver that keeps it
fed, the hybrid replicas when the job has them, and the replicas' memory report.

Knows the job config, the extensions' agent wrappers and the replica and rollout
classes; not the train engine nor the training loop, which takes this side's driver,
buffer and pool (`offbeat.core.trainer.loop`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.core.buffer import AsyncReplayBuffer
    from offbeat.core.config.schema import JobConfig
    from offbeat.core.trainer.hybrid import HybridReplicas
    from offbeat.core.trainer.memory import ReplicaMemory
    from offbeat.core.trainer.prepare import Prepared
    from offbeat.core.trainer.replicas import ReplicaPool
    from offbeat.core.trainer.rollout import RolloutDriver

__all__ = ["RolloutSide", "base_sampling", "start_rollout_side"]


def base_sampling(cfg: JobConfig) -> dict[str, Any]:
    """The sampling parameters of every training request: rollout.temperature, top_p,
    max_tokens, and top_k when set."""
    ro = cfg.rollout
    params: dict[str, Any] = {
        "temperature": ro.temperature,
        "top_p": ro.top_p,
        "max_tokens": ro.max_tokens,
    }
    if ro.top_k is not None and ro.top_k > 0:
        params["top_k"] = ro.top_k
    return params


@dataclass
class RolloutSide:
    """What `start_rollout_side` built; `close` stops the pool and the replacements it
    started (the job shuts the replicas it started down itself)."""

    balancer: AsyncLoadBalancer
    client: Any
    pool: ReplicaPool
    agent: Any  # the agent loop validation wraps (no extension's training wrapper)
    buffer: AsyncReplayBuffer
    driver: RolloutDriver
    memory: ReplicaMemory
    hybrid: HybridReplicas | None = None
    hooks: list[Any] = field(default_factory=list)  # trainer step hooks (record/replay)
    notes: list[str] = field(default_factory=list)  # for the run's header line

    async def close(self) -> None:
        await _close_pool(self.pool)


async def _close_pool(pool: ReplicaPool) -> None:
    from offbeat.core.trainer.elastic import shutdown_replicas

    await pool.close()
    await shutdown_replicas(pool.started)  # the replacements it started


async def start_rollout_side(
    p: Prepared,
    servers: dict[str, Any],
    *,
    pools: Any,
    side: Any,
    hybrids: dict[str, Any] | None,
    extensions: Sequence[Any],
    tokenizer: Any,
    processor: Any,
    version_offset: int,
) -> RolloutSide:
    """The rollout side around `servers` (answering) and `side` (the trainer side, whose
    checkpoint engines sync the replicas); `hybrids` asleep, when the job has them. On a
    failure here the pool is closed before the error goes on."""
    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.core.agent.loops import build_agent
    from offbeat.core.rewards import reward_registry
    from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
    from offbeat.core.rollout.replay import attach
    from offbeat.core.tasks import PromptDataLoader
    from offbeat.core.trainer.elastic import replacement_for
    from offbeat.core.trainer.hybrid import HybridReplicas
    from offbeat.core.trainer.memory import ReplicaMemory
    from offbeat.core.trainer.replicas import ReplicaPool
    from offbeat.core.trainer.rollout import make_buffer, make_driver

    cfg, rt = p.cfg, p.cfg.runtime
    balancer = AsyncLoadBalancer(dict(servers))
    client = PartialRolloutClient(balancer, PartialRolloutConfig(max_tokens=cfg.rollout.max_tokens))
    replacement = replacement_for(p, pools, servers) if rt.replica_replace_attempts > 0 else None
    pool = ReplicaPool(dict(servers), balancer, side.manager, replacement=replacement)
    try:
        agent = build_agent(
            cfg.agent, client, tokenizer, reward_registry(cfg.reward), base_sampling(cfg),
            prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
            on_engine_error=pool.on_engine_error,
            **({"processor": processor} if processor is not None else {}),
        )  # fmt: skip
        loader = PromptDataLoader(
            p.train_files, shuffle=cfg.data.shuffle, seed=cfg.data.seed,
            prompt_key=cfg.data.prompt_key,
        )  # fmt: skip
        train_agent = agent
        for e in extensions:
            train_agent = e.wrap_agent(train_agent)
        # rollout.replay / rollout.record: the driver's loader and agent, the trainer's hooks.
        rr = await asyncio.to_thread(
            attach, cfg, model=p.model_spec or cfg.model.path, model_dir=p.model_dir,
            tokenizer=tokenizer, loader=loader, agent=train_agent,
            version=lambda: pool.last_sync.version if pool.last_sync else version_offset,
        )  # fmt: skip
        buffer = make_buffer(cfg)
        driver = make_driver(cfg, buffer, rr.loader, rr.agent)
        pool.on_pause = driver.clock.pause
        hybrid = None
        if hybrids:
            hybrid = HybridReplicas(
                hybrids, pool, side.hybrid_manager(cfg), client=client,
                sleep_level=cfg.trainer.hybrid_sleep_level, phase_timeout_s=rt.sync_timeout_s,
            )  # fmt: skip
        memory = ReplicaMemory(pool.servers, hybrid.servers if hybrid is not None else None)
    except BaseException:
        await _close_pool(pool)
        raise
    return RolloutSide(
        balancer, client, pool, agent, buffer, driver, memory, hybrid, rr.hooks, rr.notes
    )

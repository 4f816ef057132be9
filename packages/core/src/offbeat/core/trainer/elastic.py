"""What a job starts for elastic replicas: hybrid replicas in the trainer pool (phase 1 of
a two-phase start), replacements for dead replicas in a pool's bundles (rollout
replicas, OPD teachers, GenRM judges), and their shutdown.

Knows the job config, the pools and the rollout-engine registry (`rollout.engine`); not
the training loop, nor what a replica does once started (`offbeat.core.trainer.hybrid`,
`offbeat.core.trainer.replicas`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from offbeat.core.rollout.replica_spec import ReplicaSpec, start_replica
from offbeat.core.runtime.launch import replica_options

__all__ = ["bundle_replacement", "replacement_for", "shutdown_replicas", "start_hybrid_replicas"]


async def start_hybrid_replicas(p: Any, pools: Any) -> dict[str, Any]:
    """Phase 1 of a two-phase start: one hybrid replica per trainer rank, in the rank's
    bundle of the trainer pool (the trainer must be built: `start_trainer`) on the rank's
    cores; each is awaited until it answers, then put to sleep at once."""
    from offbeat.core.cpus import share_of
    from offbeat.core.runtime.launch import hybrid_options

    cfg, rt = p.cfg, p.cfg.runtime
    n = cfg.resources.trainer_devices
    servers = {}
    for r in range(n):
        cpus = share_of(list(rt.trainer_cpus), n, r) if rt.trainer_cpus else []
        sid = f"hybrid-{r}"
        spec = ReplicaSpec(
            cfg, str(p.model_dir), r, server_id=sid, cpus=cpus,
            ray_options=hybrid_options(cfg, pools, r), hybrid=True,
        )  # fmt: skip
        servers[sid] = start_replica(spec)
    try:
        await asyncio.gather(*(s.refresh() for s in servers.values()))
        level = cfg.trainer.hybrid_sleep_level
        await asyncio.gather(*(s.sleep(level) for s in servers.values()))
    except BaseException:
        await shutdown_replicas(servers)
        raise
    return servers


def replacement_for(p: Any, pools: Any, servers: dict[str, Any]) -> Any:
    """How the job replaces a dead rollout replica: `bundle_replacement` of rollout-<i>
    in bundle i of the rollout pool."""
    cfg = p.cfg
    slots = {sid: i for i, sid in enumerate(servers)}  # start_replicas: rollout-<i> is i

    def spec(index: int, new_id: str) -> ReplicaSpec:
        options = replica_options(pools, index)
        return ReplicaSpec(cfg, str(p.model_dir), index, server_id=new_id, ray_options=options)

    return bundle_replacement(spec, slots, cfg.runtime)


def bundle_replacement(
    spec: Callable[[int, str], ReplicaSpec], slots: dict[str, int], rt: Any
) -> Any:
    """A `Replacement` for replicas in a pool's bundles (rollout replicas, OPD teachers,
    GenRM judges): kill the dead one's actor (its bundle is freed), start `spec(index,
    new_id)` (the dead one's `slots` index: its bundle) and wait until it answers
    (`rt.replica_ready_timeout_s`); `rt.replica_replace_attempts` starts in a row,
    `rt.replica_replace_backoff_s` apart, doubling."""
    import ray

    from offbeat.core.trainer.replicas import Replacement

    async def kill(server: Any) -> None:
        handle = getattr(server, "handle", None)
        if handle is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(ray.kill, handle)

    async def start(dead_id: str, new_id: str, dead: Any) -> Any:
        index = slots[new_id] = slots[dead_id]
        if dead is not None:
            await kill(dead)
        server = start_replica(spec(index, new_id))
        try:
            await asyncio.wait_for(server.refresh(), rt.replica_ready_timeout_s)
        except BaseException:
            await kill(server)
            raise
        return server

    return Replacement(start, rt.replica_replace_attempts, rt.replica_replace_backoff_s)


async def shutdown_replicas(servers: dict[str, Any]) -> None:
    import ray

    for s in servers.values():
        handle = getattr(s, "handle", None)
        if handle is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(handle.shutdown.remote(), 30)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(ray.kill, handle)

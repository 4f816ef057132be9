"""What a job starts of its replicas: the rollout replicas in the rollout pool's bundles,
hybrid replicas in the trainer pool (phase 1 of a two-phase start, `start_job_replicas`),
replacements for dead replicas in a pool's bundles (rollout replicas, OPD teachers,
GenRM judges), and their shutdown.

Knows the job config, the pools and the rollout-engine registry (`rollout.engine`); not
the training loop, nor what a replica does once started (`offbeat.core.trainer.hybrid`,
`offbeat.core.trainer.replicas`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from offbeat.core.rollout.replica_spec import ReplicaSpec, start_replica
from offbeat.core.runtime.launch import hybrid_replicas, replica_options, start_trainer

__all__ = [
    "JobReplicas",
    "await_replicas",
    "bundle_replacement",
    "replacement_for",
    "shutdown_replicas",
    "start_hybrid_replicas",
    "start_job_replicas",
    "start_replicas",
]


def start_replicas(p: Any, pools: Any = None) -> dict[str, Any]:
    """Start every rollout replica of `p` (a `Prepared` job) as rollout-<i> (not awaited:
    they come up while the trainer builds), each in bundle i of `pools`' rollout pool when
    given."""
    from offbeat.core.config.support import replica_devices

    cfg = p.cfg
    n = cfg.resources.rollout_devices // replica_devices(cfg.rollout)
    specs = [
        ReplicaSpec(cfg, str(p.model_dir), i, ray_options=replica_options(pools, i))
        for i in range(n)
    ]
    return {s.name: start_replica(s) for s in specs}


async def await_replicas(servers: dict[str, Any], version: int | None = None) -> int:
    """Wait until every replica of `servers` answers; returns `version`, or when None the
    newest weight version they hold (0 for fresh ones)."""
    await asyncio.gather(*(s.refresh() for s in servers.values() if hasattr(s, "refresh")))
    if version is not None:
        return version
    return max((int(s.weight_version) for s in servers.values()), default=0)


@dataclass
class JobReplicas:
    """Every replica a job started, by kind, and the order its parts started in."""

    servers: dict[str, Any] = field(default_factory=dict)  # rollout replicas (weight-synced)
    hybrids: dict[str, Any] = field(default_factory=dict)  # asleep in the trainer's bundles
    extensions: dict[str, Any] = field(default_factory=dict)  # teachers, judges
    order: list[str] = field(default_factory=list)

    async def shutdown(self) -> None:
        await shutdown_replicas({**self.servers, **self.hybrids, **self.extensions})


async def start_job_replicas(
    p: Any, pools: Any, extensions: Sequence[Any], into: JobReplicas
) -> Any:
    """Start the job's replicas into `into` (the caller shuts them down, also after a
    failure here); returns the trainer side when it had to start first, else None.

    With hybrid replicas it is a two-phase start. The trainer first: its ranks take their
    bundles, so the hybrid replicas can be placed beside them. Phase 1: the hybrid
    replicas start and go to sleep. Phase 2: the standalone replicas start. Then the
    extensions' replicas (`JobExtension.start_replicas`)."""
    side = None
    if hybrid_replicas(p.cfg):
        side = await start_trainer(p.cfg, pools)
        into.order.append("trainer")
        try:
            into.hybrids.update(await start_hybrid_replicas(p, pools))
            into.order.append("hybrid_asleep")
            into.servers.update(start_replicas(p, pools))
        except BaseException:
            await side.close()
            raise
    else:
        into.servers.update(start_replicas(p, pools))
    into.order.append("standalone")
    try:
        for e in extensions:  # each one's, so a failure still shuts down those before it
            into.extensions.update(e.start_replicas(p.cfg, pools))
    except BaseException:
        if side is not None:
            await side.close()
        raise
    return side


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
